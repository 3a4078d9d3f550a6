"""Where the instrument's own time went: the `harness_<phase>_time` records every isolated trial leaves
(`records.metrics.HARNESS_PHASES`), summed by phase, so the cost of measuring sits beside what was measured."""

from __future__ import annotations

import pandas as pd

from benchlib.records.metrics import HARNESS_PHASES, harness_metric

PHASE_OF = {harness_metric(phase): phase for phase in HARNESS_PHASES}


def phase_table(records: pd.DataFrame, by: tuple[str, ...] = ()) -> pd.DataFrame:
    """Seconds per phase (and per `by` columns, e.g. ("benchmark",) or ("variant",)) over every trial:
    `seconds` summed, `trials` counted, `median_s` per trial, `share` of the trials' whole time (within
    each `by` group); phases in `HARNESS_PHASES` order, a phase no trial had left out."""
    rows = records[records["metric"].isin(PHASE_OF)].assign(phase=lambda frame: frame["metric"].map(PHASE_OF))
    columns = [*by, "phase", "seconds", "trials", "median_s", "share"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    table = (rows.groupby([*by, "phase"], sort=False)["value"]
             .agg(seconds="sum", trials="size", median_s="median").reset_index())
    totals = table.groupby(list(by))["seconds"].transform("sum") if by else table["seconds"].sum()
    table["share"] = table["seconds"] / totals
    order = {phase: position for position, phase in enumerate(HARNESS_PHASES)}
    table = table.sort_values([*by, "phase"], key=lambda column: column.map(order) if column.name == "phase" else column)
    return table[columns].reset_index(drop=True)
