"""report.html's "What each rank holds" section: a step on several ranks, rank by rank, from a run's `rank_*`
records, beside the engines that ran in one process."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from benchlib.analysis.ranks import HELD_ROLES, REST, held_by_role, rank_table
from benchlib.units import format_bytes, format_seconds


def _bytes(value: float) -> str:
    return format_bytes(int(value)).replace(" ", "\u00a0") if value == value else ""


def ranks_section(records: pd.DataFrame, benchmark: str) -> list[Any]:
    """The section's parts in page order (HTML strings and a plotly figure); [] when no step ran on several ranks."""
    from benchlib.report.plots.ranks import held_per_rank

    mine = records[records["benchmark"] == benchmark]
    table = rank_table(mine)
    if table.empty:
        return []
    held = held_by_role(mine, table)
    shown = pd.DataFrame({"engine": held["engine"], "process": held["process"],
                          "holds": held["held_bytes"].map(_bytes),
                          **{words: held[words].map(_bytes) for words in (*HELD_ROLES.values(), REST)}})
    timing = pd.DataFrame({"engine": table["engine"], "rank": table["rank"].astype(int),
                           "time per step": table["time"].map(lambda v: format_seconds(v) if v == v else ""),
                           "with a collective in flight": table["communication_share"].map(
                               lambda v: f"{100 * v:.0f}%" if v == v else "")})
    return [
        "<h3>What each rank holds</h3>"
        "<p>Each rank is a process of its own, measured as any case is; a step on N devices fits where its worst "
        "rank fits. <em>Holds</em> is the rank's baseline (its share of the model and optimizer state) and its "
        "step's peak together; the roles are counted in one more step, a sharded tensor by its local shard. The rest "
        f"is the process itself: {html.escape('the interpreter, torch, communication buffers and what the allocator keeps')}.</p>",
        shown.to_html(index=False, border=0, classes="table", escape=True),
        held_per_rank(held, f"{benchmark}: what each process holds at its step's peak, by role"),
        "<p>Time per step, and the share of one more step (under torch.profiler) during which a collective was in "
        "flight, waiting for another rank included.</p>",
        timing.to_html(index=False, border=0, classes="table", escape=True)]
