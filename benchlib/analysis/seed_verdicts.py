"""Seed verdicts: did this run reproduce the claim of the discussion a notebook reproduces?

A rule is a ratio of one engine's median to a baseline engine's median, for one benchmark and
metric, and the range the seed's claim puts that ratio in. The verdict reads the 95% interval of
the ratio: `reproduced` when it lies inside the range, `refuted` when it lies wholly outside,
`inconclusive` otherwise (too few trials or too much noise to tell).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import pandas as pd

from benchlib.analysis.compare import VALUE_COLUMN, stops_by_variant, trial_values
from benchlib.analysis.derived import with_step_summaries
from benchlib.analysis.stats import median_interval, ratio_of_medians
from benchlib.records.store import resolve_run, write_parquet_atomic

REPRODUCED, REFUTED, INCONCLUSIVE = "reproduced", "refuted", "inconclusive"
VERDICTS = "verdicts.parquet"  # a run's verdict table, beside its records
BENCHMARK_COLUMN, ENGINE_COLUMN, METRIC_COLUMN = "benchmark", "variant", "metric"


@dataclass(frozen=True)
class SeedVerdict:
    """One verdict row: the claim, what this run measured (a ratio of medians, or a slope), and the
    rule that decided; `samples` and `baseline_samples` count the per-trial values it used; `reason` says
    why an inconclusive one could not decide (and how its trials stopped, where they say)."""

    benchmark: str
    claim: str
    ratio: float
    ci_low: float
    ci_high: float
    verdict: str
    rule: str
    baseline: str
    group: str = ""
    figure: str = "ratio"
    metric: str = ""
    samples: int = 0
    baseline_samples: int = 0
    reason: str = ""  # why an inconclusive verdict is one: no interval, or which bound it straddles, and the trials


def _matches(params: dict, where: tuple[tuple[str, object], ...]) -> bool:
    return all(params.get(name) == value for name, value in where)


def _groups(records: pd.DataFrame, params: pd.Series, per: tuple[str, ...]):
    """(label, rows) per combination of the `per` params ("" and all rows when `per` is empty)."""
    if not per:
        yield "", records
        return
    keys = params.map(lambda p: tuple(p.get(name) for name in per))
    for key in dict.fromkeys(keys):
        yield ", ".join(f"{name}={value}" for name, value in zip(per, key)), records[keys == key]


@dataclass(frozen=True)
class RatioRule:
    """The claim that median(metric of engine) / median(metric of baseline) lies in [low, high].

    `where` keeps rows whose params hold these values (e.g. one GC policy); `case`/`baseline_case`
    are the params that pick the two sides' cases, e.g. `(("step", "initial"),)`, to compare two cases
    of one engine (structured keys: a case label is never parsed back); `per` names params that split
    the verdict (one row per value, never pooled). Samples are trials (`trial_values`).
    """

    benchmark: str
    claim: str
    metric: str
    engine: str
    baseline: str
    low: float
    high: float
    where: tuple[tuple[str, object], ...] = ()
    case: tuple[tuple[str, object], ...] = ()
    baseline_case: tuple[tuple[str, object], ...] = ()
    per: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The rule in one line, as the verdict table and `benchlib run` show it."""
        def side(engine: str, case: tuple) -> str:
            return " ".join([engine, *(f"{name}={value}" for name, value in case)])

        where = "".join(f", {name}={value}" for name, value in self.where)
        return (f"{self.metric} {side(self.engine, self.case)} / {side(self.baseline, self.baseline_case)}{where}: "
                f"95% interval inside [{self.low:g}, {self.high:g}] reproduces, wholly outside refutes")

    @property
    def metrics(self) -> tuple[str, ...]:
        """The record metrics the rule reads: one, or two for a derived "a/b" (a ratio per trial)."""
        return tuple(self.metric.split("/"))

    def samples(self, records: pd.DataFrame, params: pd.Series) -> tuple[np.ndarray, np.ndarray]:
        """Per-trial values of the engine side and of the baseline side (`params`: the rows' parsed params)."""
        def side(variant: str, case: tuple) -> np.ndarray:
            rows = records[(records[ENGINE_COLUMN] == variant) & params.map(lambda p: _matches(p, case))]
            if "/" not in self.metric:
                return trial_values(rows)
            numerator, denominator = (trial_values(rows[rows[METRIC_COLUMN] == name]) for name in self.metrics)
            return numerator / denominator if numerator.size == denominator.size else np.array([])

        return side(self.engine, self.case), side(self.baseline, self.baseline_case)


@dataclass(frozen=True)
class SlopeRule:
    """The claim that the per-trial least-squares slope of `metric` against the param `against`,
    in units of `scale(params)` (e.g. one weight-sized buffer), has a median in [low, high]."""

    benchmark: str
    claim: str
    metric: str
    engine: str
    against: str
    unit: str
    scale: Callable[[dict], float]
    low: float
    high: float
    where: tuple[tuple[str, object], ...] = ()
    per: tuple[str, ...] = ()
    baseline = ""

    @property
    def text(self) -> str:
        return (f"slope of {self.metric} of {self.engine} against {self.against}, in {self.unit}: median over "
                f"trials, 95% interval inside [{self.low:g}, {self.high:g}] reproduces, wholly outside refutes")

    def slopes(self, records: pd.DataFrame, params: pd.Series) -> np.ndarray:
        """One slope per trial (all rows one trial when no row names its trial)."""
        rows = records[records[ENGINE_COLUMN] == self.engine]
        if rows.empty:
            return np.array([])
        rows_params = params[rows.index]
        x = rows_params.map(lambda p: p.get(self.against)).astype(float)
        trial = rows_params.map(lambda p: p.get("trial", 0))
        scale = self.scale(rows_params.iloc[0] | {"dtype": rows["dtype"].iloc[0]})
        slopes = []
        for _, group in rows.assign(_x=x, _trial=trial).groupby("_trial"):
            points = group.groupby("_x")[VALUE_COLUMN].median()
            if len(points) >= 2:
                slopes.append(float(np.polyfit(points.index.to_numpy(float), points.to_numpy(float), 1)[0]) / scale)
        return np.array(slopes)


def verdict_of(interval_low: float, interval_high: float, low: float, high: float) -> str:
    """reproduced / refuted / inconclusive from an interval and the claimed range."""
    if not (math.isfinite(interval_low) and math.isfinite(interval_high)):
        return INCONCLUSIVE
    if low <= interval_low and interval_high <= high:
        return REPRODUCED
    if interval_high < low or interval_low > high:
        return REFUTED
    return INCONCLUSIVE


def inconclusive_reason(low: float, high: float, claimed_low: float, claimed_high: float, trials: str = "") -> str:
    """Why an interval neither lies inside the claimed range nor wholly outside it, with how the trials stopped."""
    if not (math.isfinite(low) and math.isfinite(high)):
        why = "one trial a side: a point, not an interval"
    else:
        straddled = [bound for bound in (claimed_low, claimed_high) if low < bound < high or bound in (low, high)]
        why = f"the interval [{low:.3g}, {high:.3g}] straddles {' and '.join(f'{b:g}' for b in straddled)}"
    return f"{why}; {trials}" if trials else why


def _verdict(rule, ratio: float, low: float, high: float, group: str, samples: int, baseline_samples: int = 0,
             trials: str = "") -> SeedVerdict:
    verdict = verdict_of(low, high, rule.low, rule.high)
    reason = inconclusive_reason(low, high, rule.low, rule.high, trials) if verdict == INCONCLUSIVE else ""
    return SeedVerdict(rule.benchmark, rule.claim, ratio, low, high, verdict, rule.text, rule.baseline, group,
                       "slope" if isinstance(rule, SlopeRule) else "ratio", rule.metric, samples, baseline_samples,
                       reason)


def _trials_text(rows: pd.DataFrame, stops: Mapping[tuple[str, str, str], str]) -> str:
    """How the trials of the rows' engines stopped ("torch 5 trials, max_trials"), from `stops_by_variant`."""
    seen = dict.fromkeys(f"{variant} {stops[benchmark, case, variant]}" for benchmark, case, variant
                         in zip(rows[BENCHMARK_COLUMN], rows["case"], rows[ENGINE_COLUMN])
                         if (benchmark, case, variant) in stops)
    return "; ".join(seen)


def apply_rule(records: pd.DataFrame, rule, params: pd.Series | None = None,
               stops: Mapping[tuple[str, str, str], str] | None = None) -> list[SeedVerdict]:
    """The rule's verdicts on a run's records, one per group of its `per` params (none when the run
    lacks what the rule compares). One trial a side gives a point, not an interval: inconclusive.
    `stops` (`stops_by_variant` of the run) tells an inconclusive verdict how its trials stopped."""
    stops = stops or {}
    if params is None:
        params = records["params"].map(lambda text: json.loads(text) if text else {})
    metrics = rule.metrics if isinstance(rule, RatioRule) else (rule.metric,)
    keep = (records[BENCHMARK_COLUMN] == rule.benchmark) & records[METRIC_COLUMN].isin(metrics)
    keep &= records[VALUE_COLUMN].notna() & params.map(lambda p: _matches(p, rule.where))
    verdicts = []
    for group, rows in _groups(records[keep], params[keep], rule.per):
        if isinstance(rule, SlopeRule):
            slopes = rule.slopes(rows, params)
            if slopes.size == 0:
                continue
            if slopes.size < 2:
                verdicts.append(_verdict(rule, float(slopes[0]), math.nan, math.nan, group, slopes.size,
                                         trials=_trials_text(rows, stops)))
                continue
            interval = median_interval(slopes)
            verdicts.append(_verdict(rule, interval.ratio, interval.ci_low, interval.ci_high, group, slopes.size,
                                     trials=_trials_text(rows, stops)))
            continue
        values, baseline = rule.samples(rows, params[rows.index])
        if values.size == 0 or baseline.size == 0 or not np.all(baseline > 0):
            continue
        interval = ratio_of_medians(baseline, values)
        low, high = (math.nan, math.nan) if min(values.size, baseline.size) < 2 else (interval.ci_low, interval.ci_high)
        sides = rows[rows[ENGINE_COLUMN].isin([rule.engine, rule.baseline])]
        verdicts.append(_verdict(rule, interval.ratio, low, high, group, values.size, baseline.size,
                                 trials=_trials_text(sides, stops)))
    return verdicts


def _grid_point(params: str) -> str:
    """The grid point a record belongs to (`benchlib run --grid`), as text; "" outside a grid."""
    point = json.loads(params).get("grid") if params else None
    return ", ".join(f"{name}={value}" for name, value in point.items()) if point else ""


def seed_verdicts(records: pd.DataFrame, rules: tuple) -> pd.DataFrame:
    """The verdict table of a run: one row per rule (the benchmarks' declared `verdicts`), group and
    grid point the run measured (cases of different grid points, e.g. sizes, are never pooled)."""
    records = with_step_summaries(records)
    params = records["params"].map(lambda text: json.loads(text) if text else {}) if not records.empty \
        else pd.Series(dtype=object)
    points = records["params"].map(_grid_point) if not records.empty else pd.Series(dtype=str)
    rows, stops = [], stops_by_variant(records)
    for point in dict.fromkeys(points):
        inside = points == point
        for rule in rules:
            for verdict in apply_rule(records[inside], rule, params[inside], stops):
                rows.append({**asdict(verdict), "grid_point": point})
    return pd.DataFrame(rows, columns=[*SeedVerdict.__dataclass_fields__, "grid_point"])


QUICK_CAVEAT = ("quick sizes: these verdicts judge the seeds' claims at smoke-test sizes (tiny chains, "
                "few nets, two trials), where fixed per-process costs dominate; only a full run speaks for the seeds")


def verdict_text(table: pd.DataFrame, *, quick: bool = False) -> str:
    """A verdict table (`seed_verdicts`) as printed at the end of `benchlib run`: one line per claim and
    verdict, its groups (e.g. MWE and order) folded into a count and the range of their ratios; the
    report and the saved table keep every row. `quick` (a `--quick` run) heads it with `QUICK_CAVEAT`."""
    if table.empty:
        return "seed verdicts: none (no benchmark with a seed rule was measured)"
    lines = ["seed verdicts (ratio [95% interval] vs baseline):", *([f"  ({QUICK_CAVEAT})"] if quick else [])]
    for (claim, verdict, point), rows in table.groupby(["claim", "verdict", "grid_point"], sort=False):
        first = rows.iloc[0]
        versus = f" vs {first.baseline}" if first.baseline else ""
        if len(rows) == 1:
            interval = ("no interval (one trial)" if math.isnan(first.ci_low)
                        else f"[{first.ci_low:.3g}, {first.ci_high:.3g}]")
            shown, where = f"{first.ratio:.3g} {interval}", ", ".join(p for p in (first.group, point) if p)
            if first.verdict == INCONCLUSIVE and first.reason:
                where = "; ".join(p for p in (where, first.reason) if p)
        else:
            shown = f"{rows.ratio.min():.3g} to {rows.ratio.max():.3g} in {len(rows)} groups"
            where = point
        lines.append(f"  {verdict:<12}  {shown}{versus}  {claim}" + (f" [{where}]" if where else ""))
    return "\n".join(lines)


def save_verdicts(table: pd.DataFrame, run: str | os.PathLike) -> Path:
    """Write a run's verdict table (`seed_verdicts`) to `<run>/verdicts.parquet`, atomically."""
    return write_parquet_atomic(table, resolve_run(run) / VERDICTS)


def load_verdicts(run: str | os.PathLike, root: str | os.PathLike | None = None) -> pd.DataFrame | None:
    """A run's saved verdict table; None when the run has none (older runs: `benchlib report` writes it)."""
    path = resolve_run(run, root) / VERDICTS
    return pd.read_parquet(path) if path.is_file() else None


VERDICT_KEY = ["benchmark", "claim", "group", "grid_point"]


def changed_verdicts(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """The claims whose verdict differs between two runs' tables (a claim judged in one run only counts
    as changed, its other side `not judged`): benchmark, claim, group, grid_point, both verdicts and ratios."""
    merged = before[VERDICT_KEY + ["verdict", "ratio"]].merge(
        after[VERDICT_KEY + ["verdict", "ratio"]], on=VERDICT_KEY, how="outer", suffixes=("_a", "_b"))
    for side in ("verdict_a", "verdict_b"):
        merged[side] = merged[side].fillna("not judged")
    return merged[merged["verdict_a"] != merged["verdict_b"]].reset_index(drop=True)
