"""An engine comparison's summary: per case and engine, trials (and why they stopped), peak bytes, median time
and gradient error, each ratio to the hand-written baselines a ratio of medians with its 95% interval. Tables of it
are drawn in `benchlib.report.tables.engine_summary`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from benchlib.engine_names import MANUAL, MANUAL_SEED
from benchlib.records.metrics import (COMPILE_COLUMN, COMPILE_METRIC, GRAD_ERROR_METRIC, GRAD_UNCHECKED_METRIC,
                                      TRIALS_RUN)

REFERENCE_ENGINE = MANUAL  # the lean hand-written gradient: every ratio's baseline
SEED_ENGINE = MANUAL_SEED  # the seed's own hand-written gradient, the second baseline where a workload has one


@dataclass(frozen=True)
class Problem:
    """A case's engine that did not give a clean measurement: `status` "failed", "not run" or "not applicable", and
    why (`message`). The trial loop leaves them; the summary and its tables list them."""

    case: str
    engine: str
    status: str
    message: str


SUMMARY_COLUMNS = ["case", "engine", "status", "trials", "stop", "peak_bytes", "peak_ratio", "peak_ratio_low",
                   "peak_ratio_high", "time_s", "time_ratio", "time_ratio_low", "time_ratio_high", "peak_ratio_seed",
                   "peak_ratio_seed_low", "peak_ratio_seed_high", COMPILE_COLUMN, GRAD_ERROR_METRIC, "reason"]


def summarize(frame: pd.DataFrame, problems: Iterable[Problem] = (), engine_order: Sequence[str] = ()
              ) -> pd.DataFrame:
    """Trials (and why they stopped), peak bytes, median time and gradient error per case and engine, with ratios to `manual`
    (the lean floor: `peak_ratio`, `time_ratio`) and, where it ran, to `manual-seed` (the seed's own
    hand-written gradient: `peak_ratio_seed`), rows in `engine_order` within each case.

    Each ratio is a ratio of medians over trials with its 95% bootstrap interval (`*_low`, `*_high`;
    NaN with a single trial a side, which gives a point, not an interval).
    """
    from benchlib.analysis.compare import trial_values

    columns = SUMMARY_COLUMNS
    rows, samples = [], {}
    for (case, engine), group in frame.groupby(["case", "variant"], sort=False):
        by_metric = {metric: trial_values(rows_of_metric) for metric, rows_of_metric in group.groupby("metric")}
        if "time" not in by_metric:
            continue
        samples[case, engine] = by_metric
        unchecked = group[group["metric"] == GRAD_UNCHECKED_METRIC]["params"]
        stops = group.loc[group["metric"] == TRIALS_RUN, "params"].map(lambda p: json.loads(p)["stop"])
        rows.append({"case": case, "engine": engine, "status": "ok", "trials": len(by_metric["time"]),
                     "stop": stops.iloc[0] if len(stops) else "",
                     "peak_bytes": float(np.median(by_metric["peak_bytes"])) if "peak_bytes" in by_metric else math.nan,
                     "time_s": float(np.median(by_metric["time"])),
                     COMPILE_COLUMN: float(np.median(by_metric[COMPILE_METRIC])) if COMPILE_METRIC in by_metric
                     else math.nan,
                     GRAD_ERROR_METRIC: float(np.max(by_metric[GRAD_ERROR_METRIC])) if GRAD_ERROR_METRIC in by_metric
                     else math.nan,
                     "reason": "".join(f"gradient not checked: {json.loads(p)['message']}" for p in unchecked[:1])})
    measured = {(row["case"], row["engine"]): row for row in rows}
    for problem in problems:
        row = measured.get((problem.case, problem.engine))
        if row is not None:  # measured, then failed (a wrong gradient, a later trial): one row, never `ok`
            row.update(status=problem.status, reason=problem.message)
            continue
        rows.append({"case": problem.case, "engine": problem.engine, "status": problem.status, "trials": 0,
                     "stop": "",
                     "peak_bytes": math.nan, "time_s": math.nan, COMPILE_COLUMN: math.nan, GRAD_ERROR_METRIC: math.nan,
                     "reason": problem.message})
    table = pd.DataFrame(rows, columns=columns)
    if table.empty:
        return table
    for index, row in table.iterrows():
        own = samples.get((row["case"], row["engine"]))
        for baseline, ratios in ((REFERENCE_ENGINE, (("peak_bytes", "peak_ratio"), ("time", "time_ratio"))),
                                 (SEED_ENGINE, (("peak_bytes", "peak_ratio_seed"),))):
            _fill_ratios(table, index, samples.get((row["case"], baseline)), own, ratios,
                         itself=row["engine"] == baseline)
    order = {name: index for index, name in enumerate(engine_order)}
    table["_case_order"] = table["case"].map({case: i for i, case in enumerate(dict.fromkeys(table["case"]))})
    table["_engine_order"] = table["engine"].map(order)
    return (table.sort_values(["_case_order", "_engine_order"], kind="stable")
            .drop(columns=["_case_order", "_engine_order"]).reset_index(drop=True))


def _fill_ratios(table: pd.DataFrame, index, reference: dict | None, own: dict | None, ratios, *, itself: bool) -> None:
    """Each (metric, column) of `ratios`: own over reference, a ratio of medians with its interval."""
    from benchlib.analysis.stats import ratio_of_medians

    if reference is None or own is None:
        return
    if itself:  # its own baseline: exactly 1, no interval to take
        table.loc[index, [column for _, column in ratios]] = 1.0
        return
    for metric, column in ratios:
        a, b = reference.get(metric), own.get(metric)
        if a is None or b is None or not np.all(a > 0):
            continue
        interval = ratio_of_medians(a, b)
        single = min(a.size, b.size) < 2
        table.loc[index, [column, f"{column}_low", f"{column}_high"]] = (
            interval.ratio, math.nan if single else interval.ci_low, math.nan if single else interval.ci_high)
