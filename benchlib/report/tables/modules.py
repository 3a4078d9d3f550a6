"""report.html's "Which module holds the memory" section: memory by module path per engine, from a run's
`module_bytes` records: the largest module of each engine, an icicle, and the top modules by bytes."""

from __future__ import annotations

import html
import json
from typing import Any

import pandas as pd

from benchlib.analysis.modules import ROLE_ORDER, ROLE_WORDS, module_table, module_totals
from benchlib.engine_names import REFERENCE
from benchlib.records.metrics import MODULE_METRIC
from benchlib.units import format_bytes

TOP = 10  # modules per engine in a table
NBSP = "\u00a0"  # a number and its unit stay on one line


def _bytes(value: float) -> str:
    return format_bytes(int(value)).replace(" ", NBSP) if value > 0 else ""


def _top_table(totals: pd.DataFrame) -> str:
    shown = pd.DataFrame({"module": totals["module"],
                          **{ROLE_WORDS[role]: totals[role].map(_bytes) for role in ROLE_ORDER},
                          "total": totals["total"].map(_bytes),
                          "share": totals["share"].map(lambda v: f"{100 * v:.1f}%" if v == v else "")})
    return shown.head(TOP).to_html(index=False, border=0, classes="table", escape=True)


def _depth(rows: pd.DataFrame) -> str:
    depths = {json.loads(params).get("module_depth") for params in rows["params"]}
    return f" (module paths to depth {depths.pop()})" if len(depths) == 1 and None not in depths else ""


def modules_section(records: pd.DataFrame, benchmark: str) -> list[Any]:
    """The section's parts in page order, HTML strings and a plotly figure; [] when `benchmark` has no
    memory by module."""
    from benchlib.report.plots.modules import memory_by_module

    rows = records[(records["benchmark"] == benchmark) & (records["metric"] == MODULE_METRIC)]
    table = module_table(rows)
    if table.empty:
        return []
    totals = module_totals(table)
    engines = list(dict.fromkeys(zip(totals["case"], totals["engine"])))
    engines.sort(key=lambda key: key[1] != REFERENCE)
    several = len({case for case, _ in engines}) > 1
    esc = html.escape
    firsts = [totals[(totals["case"] == case) & (totals["engine"] == engine)].iloc[0] for case, engine in engines]
    largest = pd.DataFrame({
        "engine": [f"{row['case']} {row['engine']}" if several else row["engine"] for row in firsts],
        "largest module": [row["module"] for row in firsts],
        "share": [f"{100 * row['share']:.0f}%" for row in firsts],
        "its bytes": [_bytes(row["total"]) for row in firsts],
        "mostly": [ROLE_WORDS[max(ROLE_ORDER, key=lambda role: row[role])] for row in firsts]})
    parts: list[Any] = [
        "<h3>Which module holds the memory</h3>"
        f"<p>Bytes by module path{esc(_depth(rows))}: each parameter's bytes, its gradient and its optimizer state "
        "belong to the module that owns it; saved activations to the innermost module whose forward saved them. "
        "Each role is counted at its own most during one more step after the measured ones, so a module's roles "
        "sum to the role totals above; the share is of everything the modules hold.</p>",
        largest.to_html(index=False, border=0, classes="table", escape=True),
        memory_by_module(table, f"{benchmark}: memory by module path and role (pick the engine on the right)")]
    for index, (case, engine) in enumerate(engines):
        name = f"{case} {engine}" if several else engine
        top = _top_table(totals[(totals["case"] == case) & (totals["engine"] == engine)])
        parts.append(f"<h4>{esc(name)}: the {TOP} modules holding the most</h4>{top}" if index == 0 else
                     f"<details><summary>{esc(name)}: the {TOP} modules holding the most</summary>{top}</details>")
    return parts
