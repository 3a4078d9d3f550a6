"""Seed verdicts: did this run reproduce the claim of the discussion a notebook reproduces?

A rule is a ratio of one engine's median to a baseline engine's median, for one benchmark and
metric, and the range the seed's claim puts that ratio in. The verdict reads the 95% interval of
the ratio: `reproduced` when it lies inside the range, `refuted` when it lies wholly outside,
`inconclusive` otherwise (too few trials or too much noise to tell).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import pandas as pd

from benchlib.results.compare import VALUE_COLUMN, trial_values
from benchlib.results.stats import ratio_of_medians

REPRODUCED, REFUTED, INCONCLUSIVE = "reproduced", "refuted", "inconclusive"
BENCHMARK_COLUMN, CASE_COLUMN, ENGINE_COLUMN, METRIC_COLUMN = "benchmark", "case", "variant", "metric"


@dataclass(frozen=True)
class SeedVerdict:
    """One verdict row: the claim, what this run measured, and the rule that decided."""

    benchmark: str
    claim: str
    ratio: float
    ci_low: float
    ci_high: float
    verdict: str
    rule: str
    baseline: str


@dataclass(frozen=True)
class RatioRule:
    """The claim that median(metric of engine) / median(metric of baseline) lies in [low, high]."""

    benchmark: str
    claim: str
    metric: str
    engine: str
    baseline: str
    low: float
    high: float

    @property
    def text(self) -> str:
        """The rule in one line, as the verdict table and `benchlib run` show it."""
        return (f"{self.metric} {self.engine}/{self.baseline}: 95% interval inside "
                f"[{self.low:g}, {self.high:g}] reproduces, wholly outside refutes")


SEED_RULES: tuple[RatioRule, ...] = (
    RatioRule("dot_chain", "autograd #219: deferred accumulation peaks at about 2x the manual floor",
              "peak_bytes", "benchlib-deferred", "manual", 1.5, 2.5),
    RatioRule("dot_chain", "autograd #219: in-place accumulation peaks at the manual floor",
              "peak_bytes", "benchlib-inplace", "manual", 0.9, 1.1),
    RatioRule("mnist_ensembles", "Flux GC thread: one batched step for the ensemble raises throughput over the per-model loop",
              "throughput", "batched_hand", "naive", 2.0, math.inf),
    RatioRule("mnist_ensembles", "NaiveGAflux: the optimiser step inside backward lowers peak gradient memory",
              "peak_bytes", "step_in_backward", "naive", 0.0, 0.95),
)


def verdict_of(interval_low: float, interval_high: float, low: float, high: float) -> str:
    """reproduced / refuted / inconclusive from an interval and the claimed range."""
    if not (math.isfinite(interval_low) and math.isfinite(interval_high)):
        return INCONCLUSIVE
    if low <= interval_low and interval_high <= high:
        return REPRODUCED
    if interval_high < low or interval_low > high:
        return REFUTED
    return INCONCLUSIVE


def apply_rule(records: pd.DataFrame, rule: RatioRule) -> SeedVerdict | None:
    """The rule's verdict on a run's records, all cases of an engine pooled; None when the run lacks them."""
    selected = records[(records[BENCHMARK_COLUMN] == rule.benchmark) & (records[METRIC_COLUMN] == rule.metric)]
    selected = selected.dropna(subset=[VALUE_COLUMN])
    values = trial_values(selected[selected[ENGINE_COLUMN] == rule.engine])
    baseline = trial_values(selected[selected[ENGINE_COLUMN] == rule.baseline])
    if values.size == 0 or baseline.size == 0:
        return None
    interval = ratio_of_medians(baseline, values)
    if min(values.size, baseline.size) < 2:  # one trial a side: a point, not an interval
        low = high = math.nan
    else:
        low, high = interval.ci_low, interval.ci_high
    return SeedVerdict(rule.benchmark, rule.claim, interval.ratio, low, high,
                       verdict_of(low, high, rule.low, rule.high), rule.text, rule.baseline)


def _grid_point(params: str) -> str:
    """The grid point a record belongs to (`benchlib run --grid`), as text; "" outside a grid."""
    point = json.loads(params).get("grid") if params else None
    return ", ".join(f"{name}={value}" for name, value in point.items()) if point else ""


def seed_verdicts(records: pd.DataFrame, rules: tuple[RatioRule, ...] = SEED_RULES) -> pd.DataFrame:
    """The verdict table of a run: one row per rule whose benchmark and engines the run measured, per
    grid point (cases of different grid points, e.g. sizes, are never pooled)."""
    points = records["params"].map(_grid_point) if not records.empty else pd.Series(dtype=str)
    rows = []
    for point in dict.fromkeys(points):
        subset = records[points == point]
        for rule in rules:
            verdict = apply_rule(subset, rule)
            if verdict is not None:
                rows.append({**asdict(verdict), "grid_point": point})
    return pd.DataFrame(rows, columns=[*SeedVerdict.__dataclass_fields__, "grid_point"])


def verdict_text(records: pd.DataFrame) -> str:
    """The verdict table as printed at the end of `benchlib run` (one line when no rule applies)."""
    table = seed_verdicts(records)
    if table.empty:
        return "seed verdicts: none (no benchmark with a seed rule was measured)"
    lines = ["seed verdicts (ratio [95% interval] vs baseline):"]
    for row in table.itertuples():
        interval = "no interval (one trial)" if math.isnan(row.ci_low) else f"[{row.ci_low:.3g}, {row.ci_high:.3g}]"
        point = f" [{row.grid_point}]" if row.grid_point else ""
        lines.append(f"  {row.verdict:<12}  {row.ratio:.3g} {interval} vs {row.baseline}  {row.claim}{point}")
    return "\n".join(lines)
