"""Steps on several ranks, read back from a run's `rank_*` records: what each rank held and spent, and which
rank is the worst (a step on N devices fits where its worst rank fits)."""

from __future__ import annotations

import json

import pandas as pd

from benchlib.records.metrics import RANK_PREFIX
from benchlib.units import format_bytes

RANK_COLUMNS = ["case", "engine", "world_size", "rank", "held_bytes", "baseline_bytes", "peak_bytes", "time",
                "communication_share", "role_parameter_bytes", "role_optimizer_bytes", "role_gradient_bytes",
                "role_saved_bytes", "role_gathered_bytes"]


def rank_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (case, engine, rank) of a step on several ranks: the median over trials of each of its figures,
    and `held_bytes`, its baseline and peak together (what the rank's device must hold)."""
    rows = records[records["metric"].str.startswith(RANK_PREFIX)]
    if rows.empty:
        return pd.DataFrame(columns=RANK_COLUMNS)
    params = rows["params"].map(json.loads)
    frame = pd.DataFrame({"case": rows["case"].to_numpy(), "engine": rows["variant"].to_numpy(),
                          "world_size": params.map(lambda p: p.get("world_size")).to_numpy(),
                          "rank": params.map(lambda p: p["rank"]).to_numpy(),
                          "metric": rows["metric"].str.removeprefix(RANK_PREFIX).to_numpy(),
                          "value": rows["value"].to_numpy(float)})
    wide = frame.pivot_table(index=["case", "engine", "world_size", "rank"], columns="metric", values="value",
                             aggfunc="median", sort=False).reset_index()
    wide["held_bytes"] = wide.get("baseline_bytes", 0.0) + wide.get("peak_bytes", 0.0)
    return wide.reindex(columns=RANK_COLUMNS)


def ranks_words(table: pd.DataFrame, case: str, engine: str, held: float) -> str:
    """"on 2 ranks, worst rank 1 holds 45.2 MB (rank 0: 44.9 MB), 12% of a step in collectives": the summary
    line's words for a step on several ranks; for one process in a run that has some, what it `held` (its
    baseline and peak) to set beside theirs; "" in a run on one process."""
    rows = table[(table["case"] == case) & (table["engine"] == engine)]
    if rows.empty:
        return f"  one process holds {format_bytes(int(held))}" if not table.empty and held == held else ""
    worst = rows.loc[rows["held_bytes"].idxmax()]
    others = ", ".join(f"rank {int(row.rank)}: {format_bytes(int(row.held_bytes))}"
                       for row in rows.itertuples() if row.rank != worst["rank"])
    share = worst["communication_share"]
    talk = f", {100 * share:.0f}% of a step in collectives" if share == share else ""
    return (f"  on {int(worst['world_size'])} ranks, worst rank {int(worst['rank'])} holds "
            f"{format_bytes(int(worst['held_bytes']))}" + (f" ({others})" if others else "") + talk)


HELD_ROLES = {"role_parameter_bytes": "parameters", "role_optimizer_bytes": "optimizer state",
              "role_gradient_bytes": "gradients", "role_saved_bytes": "saved activations",
              "role_gathered_bytes": "gathered parameters"}
REST = "the rest of the process"  # interpreter, libraries, communication buffers, the allocator's keep


def held_by_role(records: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """What each process of a run with steps on several ranks held at its peak, by role: a row per rank of each
    such step (`rank_table`), and one per engine that ran in one process, to set beside them; `REST` is the held
    bytes no role accounts for. Empty for a run on one process."""
    if table.empty:
        return pd.DataFrame(columns=["case", "engine", "process", *HELD_ROLES.values(), REST, "held_bytes"])
    rows = [{"case": row.case, "engine": row.engine, "process": f"rank {int(row.rank)} of {int(row.world_size)}",
             **{words: getattr(row, metric) for metric, words in HELD_ROLES.items()}, "held_bytes": row.held_bytes}
            for row in table.itertuples()]
    alone = records[~records["variant"].isin(set(table["engine"]))]
    medians = alone.groupby(["case", "variant", "metric"], sort=False)["value"].median()
    for (case, engine), of_engine in medians.groupby(level=["case", "variant"], sort=False):
        values = of_engine.droplevel(["case", "variant"])
        if "baseline_bytes" in values and "peak_bytes" in values:
            rows.insert(0, {"case": case, "engine": engine, "process": "one process",
                            **{words: values.get(metric, 0.0) for metric, words in HELD_ROLES.items()},
                            "held_bytes": values["baseline_bytes"] + values["peak_bytes"]})
    frame = pd.DataFrame(rows).fillna(0.0)
    alone = frame["process"] == "one process"  # first, then each step on ranks, rank by rank
    frame = pd.concat([frame[alone], frame[~alone].sort_values(["case", "engine", "process"], kind="stable")])
    frame[REST] = (frame["held_bytes"] - frame[list(HELD_ROLES.values())].sum(axis=1)).clip(lower=0.0)
    return frame
