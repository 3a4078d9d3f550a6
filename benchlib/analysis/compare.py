"""Did a change make things better? Per metric, run B against run A (asv `compare`, pyperf `compare_to`).

The statistics come from `benchlib.analysis.stats` and take plain arrays; the record columns they are
grouped by are named once, in `KEY_COLUMNS`, `VALUE_COLUMN` and `UNIT_COLUMN`.
"""

from __future__ import annotations

import functools
import json
import textwrap
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchlib.errors import Refused
from benchlib.analysis.derived import with_step_summaries
from benchlib.records.metrics import HARNESS_PHASES, METRICS, TRIALS_RUN, harness_metric
from benchlib.analysis.stats import (
    BETTER,
    DEFAULT_ALPHA,
    INCONCLUSIVE,
    SAME,
    WORSE,
    RatioInterval,
    judge,
    noise_flags,
    ratio_of_medians,
)
from benchlib.records.store import load_records, resolve_run
from benchlib.units import unit_scale

KEY_COLUMNS = ("benchmark", "case", "dimension", "variant", "device", "dtype", "metric")
VALUE_COLUMN = "value"
METRIC_NAME = "metric"
UNIT_COLUMN = "unit"
DEFAULT_THRESHOLD = 0.05
NOISY = "noisy"
NO_DIRECTION = "no direction"

# Which way each unit counts as better: lower time, bytes and counts; higher rates.
LOWER_IS_BETTER_BY_UNIT = {
    "s": True,
    "B": True,
    "count": True,
    "B/s": False,
    "FLOP/s": False,
    "model-samples/s": False,
}

def lower_is_better(metric: str, unit: str) -> bool | None:
    """Which way `metric` counts as better: as registered where its registration says (a largest fitting value:
    higher), else by its unit; None where neither has a way (ratios, flags)."""
    better = METRICS[metric].better if metric in METRICS else None
    return LOWER_IS_BETTER_BY_UNIT.get(unit) if better is None else better == "lower"


# Units of timed measurements: they drift with the machine's state between sittings.
TIMED_UNITS = frozenset({"s", "B/s", "FLOP/s", "model-samples/s"})

TIGHT_SPREAD_OF_THRESHOLD = 0.25  # sizes whose trials agree within this share of the threshold decide by range

# What shaped a number rather than a result (the memory a process held before the measured work), and
# the per-collection records, whose repeats are collections of all generations in whatever number a
# run happened to make (their per-step sums, step_gc_time and step_gc_pauses, are judged): shown, never judged.
CONTEXT_METRICS = frozenset({"baseline_bytes", "gc_pause_time", "gc_pause_generation", "gc_pause_collected",
                             "gc_pause_uncollectable", "gc_pause_tracked", "gc_pause_step",
                             # an attribution pass (--attribute): where the bytes went, and what capturing it cost
                             "trials_run", "site_bytes", "site_count", "site_bytes_diff", "site_count_diff", "attribution_call_time",
                             "attribution_read_time", "attribution_peak_bytes", "attribution_unattributed_bytes",
                             # the instrument's own time, phase by phase (a slower harness is no regression of the code)
                             *(harness_metric(phase) for phase in HARNESS_PHASES)})

# Params that describe one measurement rather than the configuration measured: the trial's place in
# its order (and how many trials there were, so runs with different trial counts still match), the
# load before it, what the allocation pass used, samples a sampler managed to take; and which model
# file (and version of it) held the code, since the code is what two runs of one NAME compare; and which rank of a
# step on several was its worst in a trial (every rank's own figures are `rank_*` records keyed by `rank`).
MEASUREMENT_PARAMS = frozenset({"trial", "trials", "order_seed", "position", "loadavg_1m_before", "alloc_source",
                                "alloc_steps", "samples_per_call", "file", "version", "precision", "stop",
                                "precision_reached", "isolation", "worst_rank"})
CONFIG_COLUMN = "config"  # the params that name what was measured (sizes, policies...), as JSON


def with_config(records: pd.DataFrame) -> pd.DataFrame:
    """`records` with the `config` column: values measured under different params (calibration's matrix
    sizes) are never pooled into one sample, and two runs match only on the same configuration."""
    def config(params: str) -> str:
        values = json.loads(params) if params else {}
        return json.dumps({k: v for k, v in values.items() if k not in MEASUREMENT_PARAMS}, sort_keys=True)

    return records.assign(**{CONFIG_COLUMN: records["params"].map(config)})


COMPARE_COLUMNS = [*KEY_COLUMNS, UNIT_COLUMN, CONFIG_COLUMN, "n_a", "n_b", "median_a", "median_b", "ratio", "ci_low",
                   "ci_high", "p_value", "label", "noise", "stopped"]


def trial_values(group: pd.DataFrame) -> np.ndarray:
    """One value per independent trial: the median of each case's trial's rows (repeats, steps) when the
    rows' params name their `trial`, else every row's value (rows of one process are then the sample)."""
    values = group[VALUE_COLUMN].to_numpy(float)
    trials = group["params"].map(_trial_of)
    if group.empty or trials.isna().any():
        return values
    return group.groupby([group["case"].to_numpy(), trials.to_numpy()])[VALUE_COLUMN].median().to_numpy(float)


def trial_values_by(records: pd.DataFrame, keys: list[str]) -> dict[tuple, np.ndarray]:
    """`trial_values` of each group of `records` by `keys`, in one pass over the frame: the summary and the report
    read every engine's every metric, where a groupby per group cost milliseconds each."""
    if records.empty:
        return {}
    trials = records["params"].map(_trial_of)
    frame = records.assign(_trial=trials.to_numpy(), _untrialed=trials.isna().to_numpy())
    untrialed = frame.groupby(keys, sort=False)["_untrialed"].transform("any").to_numpy(bool)
    medians = frame[~untrialed].groupby([*keys, "case", "_trial"] if "case" not in keys else [*keys, "_trial"],
                                        sort=True)[VALUE_COLUMN].median()
    values = {key: group.to_numpy(float) for key, group in medians.groupby(level=list(range(len(keys))), sort=False)}
    for key, group in frame[untrialed].groupby(keys, sort=False):
        values[key] = group[VALUE_COLUMN].to_numpy(float)
    return {key if isinstance(key, tuple) else (key,): value for key, value in values.items()}


def has_trials(group: pd.DataFrame) -> bool:
    """Whether every row names its `trial`: then the trials, not the rows, are independent samples."""
    return not group.empty and not group["params"].map(_trial_of).isna().any()


@functools.lru_cache(maxsize=1 << 16)
def _trial_of(params: str) -> int | None:
    """The trial a row's params name; one trial's rows share one params text, so each text is parsed once (the
    summary and the report read every metric's trials: parsing each row's JSON was most of their time)."""
    return json.loads(params).get("trial") if params else None


def _mann_whitney_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p where both sides have trials (nan otherwise; 1 when every value ties)."""
    if a.size < 2 or b.size < 2:
        return math.nan
    if np.ptp(np.concatenate([a, b])) == 0:
        return 1.0
    from scipy.stats import mannwhitneyu  # ~0.4 s to import: only where a rank test is made, not in every importer

    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


@dataclass(frozen=True)
class _Samples:
    """One key's values in run A and in run B; `independent` when both sides' values are trials."""

    a: np.ndarray
    b: np.ndarray
    independent: bool


def _label(samples: _Samples, interval: RatioInterval, noise: list[str], *, metric: str, unit: str,
           threshold: float) -> str:
    """The label of one metric, B against A.

    Timings: `worse`/`better` only from the rank test over trials (p < 0.01 and the threshold: five
    trials a side at least). Rows of one process without trials (`independent` false) share a
    sitting, and their scatter says nothing of the drift between two sittings (timings of one
    commit moved 1.3-1.7x between two runs on the shared 2-core VM), so they are not tested.
    Sizes and counts measured tightly (two values a side, each side's max/min within a quarter of
    the threshold, as fresh-process peaks are) decide by their ranges lying apart by more than the
    threshold; loose ones (an in-kernel peak moves 4-50% between trials) would gate on chance
    across hundreds of metrics. `same` when the test cannot decide but, with two values a side, the
    ratio's whole 95% interval lies within the threshold (equivalence shown, e.g. peak bytes).
    """
    lower = lower_is_better(metric, unit)
    if lower is None or metric in CONTEXT_METRICS:
        return NO_DIRECTION
    a, b, independent = samples.a, samples.b, samples.independent
    timed, enough = unit in TIMED_UNITS, min(a.size, b.size) >= 2
    spread = threshold * TIGHT_SPREAD_OF_THRESHOLD
    tight = enough and a.max() <= a.min() * (1 + spread) and b.max() <= b.min() * (1 + spread)
    if not timed and tight:
        if b.min() > a.max() * (1 + threshold):
            return WORSE if lower else BETTER
        if b.max() < a.min() * (1 - threshold):
            return BETTER if lower else WORSE
    if timed and not independent:
        return NOISY if noise else INCONCLUSIVE
    label = judge(a, b, lower_is_better=lower, alpha=DEFAULT_ALPHA, min_effect=threshold) \
        if independent else INCONCLUSIVE
    if label == INCONCLUSIVE and enough and 1 - threshold <= interval.ci_low and interval.ci_high <= 1 + threshold:
        return SAME
    if label in (SAME, INCONCLUSIVE) and noise:
        return NOISY
    return label


def compare_records(records_a: pd.DataFrame, records_b: pd.DataFrame, *, threshold: float = DEFAULT_THRESHOLD,
                    metrics: list[str] | None = None, benchmarks: list[str] | None = None) -> pd.DataFrame:
    """One row per key present in both runs: ratio B/A of medians with its 95% interval, p and label.

    The samples are the runs' trials (`trial_values`): repeats inside one process are not independent,
    so without trials on both sides p is not computed and a timing is at most "noisy" (`_label`).

    A label is "worse"/"better" with Mann-Whitney p < 0.01 *and* |ratio - 1| >= threshold, or for
    sizes and counts when the two sides' ranges lie apart by the threshold (`_label`); too few
    trials to decide give "inconclusive", a noisy side "noisy"; units without a direction
    (ratios, flags) get "no direction" and never gate.
    """
    if not 0 <= threshold < 1:
        raise Refused(f"threshold must lie in [0, 1) (a relative change, 0.05 = 5%), got {threshold!r}")
    keys = [*KEY_COLUMNS, UNIT_COLUMN, CONFIG_COLUMN]
    prepared = [with_step_summaries(records) for records in (records_a, records_b)]
    for column, names in (("metric", metrics), ("benchmark", benchmarks)):  # a typo must not read as "no change"
        held = sorted(set(prepared[0][column]) | set(prepared[1][column]))
        unknown = [name for name in names or () if name not in held]
        if unknown:
            raise Refused(f"{column} {', '.join(unknown)}: in neither run; they hold: {', '.join(held)}")
    filtered = []
    for selected in prepared:
        if metrics:
            selected = selected[selected["metric"].isin(metrics)]
        if benchmarks:
            selected = selected[selected["benchmark"].isin(benchmarks)]
        filtered.append(with_config(selected.dropna(subset=[VALUE_COLUMN])))
    groups_a = dict(iter(filtered[0].groupby(keys, sort=True)))
    groups_b = dict(iter(filtered[1].groupby(keys, sort=True)))
    stops = [stops_by_variant(records) for records in (records_a, records_b)]
    rows = []
    for key, group_a in groups_a.items():
        if key not in groups_b:
            continue
        group_b = groups_b[key]
        a, b = trial_values(group_a), trial_values(group_b)
        independent = has_trials(group_a) and has_trials(group_b)
        median_a, median_b = float(np.median(a)), float(np.median(b))
        unit = key[-2]
        if median_a > 0 and np.all(a > 0) and np.all(np.isfinite(b)):
            interval = ratio_of_medians(a, b)
            ratio, ci_low, ci_high = interval.ratio, interval.ci_low, interval.ci_high
            noise = [f"A: {flag}" for flag in noise_flags(a)] + [f"B: {flag}" for flag in noise_flags(b)]
            label = _label(_Samples(a, b, independent), interval, noise, metric=key[KEY_COLUMNS.index(METRIC_NAME)],
                           unit=unit, threshold=threshold)
        else:  # zero or negative values (e.g. zero allocations): no ratio to take
            ratio = ci_low = ci_high = math.nan
            noise = []
            label = SAME if np.array_equal(np.sort(a), np.sort(b)) else NO_DIRECTION
        p_value = _mann_whitney_p(a, b) if independent else math.nan
        variant = (key[0], key[1], key[3])
        stopped = "; ".join(f"{side}: {stop[variant]}" for side, stop in zip("AB", stops) if variant in stop)
        rows.append([*key, a.size, b.size, median_a, median_b, ratio, ci_low, ci_high, p_value, label,
                     "; ".join(noise), stopped])
    table = pd.DataFrame(rows, columns=COMPARE_COLUMNS)
    table.attrs[ONE_SIDED] = {side: [key_name(pd.Series(dict(zip(keys, key)))) for key in mine if key not in theirs]
                              for side, mine, theirs in (("A", groups_a, groups_b), ("B", groups_b, groups_a))}
    return table


ONE_SIDED = "one_sided"  # compare_records' table.attrs: side -> the names of measurements only that run holds (a
# module, engine or metric renamed or gone between the runs), which nothing was compared with


def one_sided_text(comparison: pd.DataFrame, shown: int = 5) -> str:
    """What was not compared because only one run holds it, or "" where both hold the same measurements."""
    sides = comparison.attrs.get(ONE_SIDED, {})
    parts = [f"only in {side}: {', '.join(names[:shown])}" + (f" and {len(names) - shown} more" if len(names) > shown
                                                                else "")
             for side, names in sides.items() if names]
    return ("not compared (in one run only; a renamed module, engine or metric is another measurement): "
            + "; ".join(parts)) if parts else ""


NOISE_COLUMNS = [*KEY_COLUMNS, UNIT_COLUMN, CONFIG_COLUMN, "trials", "median", "max_over_min", "flags"]


def noise_table(records: pd.DataFrame, *, load_average: float | None = None, cores: int | None = None) -> pd.DataFrame:
    """Measurements not to trust, pyperf style: one row per key whose trials (`trial_values`, at least
    two) spread too much or hold a robust outlier (`noise_flags`), plus every timed key when the load
    average at the run's start exceeded the cores. Timed keys only (counts and bytes do not drift), and
    not GC pause times (mostly zero, a pause is an event, not noise) nor context (the harness's own phases)."""
    rows = []
    timed = records[records[UNIT_COLUMN].isin(TIMED_UNITS) & ~records[METRIC_NAME].str.contains("gc_")
                    & ~records[METRIC_NAME].isin(CONTEXT_METRICS)].dropna(subset=[VALUE_COLUMN])
    for key, group in with_config(timed).groupby([*KEY_COLUMNS, UNIT_COLUMN, CONFIG_COLUMN], sort=False):
        values = trial_values(group)
        if values.size < 2 or not np.all(np.isfinite(values)) or not np.all(values > 0):
            continue
        flags = noise_flags(values, load_average=load_average, cores=cores)
        if flags:
            rows.append([*key, values.size, float(np.median(values)), float(values.max() / values.min()),
                         "; ".join(flags)])
    table = pd.DataFrame(rows, columns=NOISE_COLUMNS)
    return table.sort_values("max_over_min", ascending=False, kind="stable").reset_index(drop=True)


def noise_text(table: pd.DataFrame, shown: int = 5) -> str:
    """The run summary's noise lines: how many measurements are flagged, and the first few."""
    if table.empty:
        return "noise: no timed measurement flagged (spread, outliers, load at start)"
    lines = [f"noise: {len(table)} timed measurement(s) flagged (tables/noise.parquet); "
             f"the {min(shown, len(table))} widest (max/min over trials):"]
    for row in table.head(shown).itertuples():
        lines.append(f"  {row.benchmark} {row.case} {row.variant} {row.metric}: {row.flags}")
    return "\n".join(lines)


def compare_runs(run_a: str | Path, run_b: str | Path, *, root: Path | None = None, **options) -> pd.DataFrame:
    """`compare_records` on two runs given by run id (under `root`) or directory; a run without
    records is refused (ValueError), as nothing can be said about it."""
    records = [load_records(run, root) for run in (run_a, run_b)]
    for run, frame in zip((run_a, run_b), records):
        if frame.empty:
            raise Refused(f"{resolve_run(run, root)} has no records: nothing to compare")
    return compare_records(*records, **options)


LABELS = (WORSE, BETTER, SAME, NOISY, INCONCLUSIVE, NO_DIRECTION)


def headline(comparison: pd.DataFrame, shown: int = 10) -> list[str]:
    """The answer before the table: how many metrics got each label, then the worst regressions
    (furthest from a ratio of 1), so a reader need not scan the table for them."""
    counts = comparison["label"].value_counts()
    lines = [f"{len(comparison)} metric(s): " + ", ".join(f"{counts.get(label, 0)} {label}" for label in LABELS)]
    worse = comparison[comparison["label"] == WORSE]
    if worse.empty:
        return [*lines, "no regression"]
    worst = worse.assign(distance=np.abs(np.log(worse["ratio"]))).sort_values("distance", ascending=False,
                                                                                na_position="last")
    lines.append(f"worst regressions ({min(shown, len(worst))} of {len(worst)}), B/A with 95% interval:")
    for name, row in zip(distinct_names(worst.head(shown)), worst.head(shown).itertuples()):
        lines.append(f"  {name}: {row.ratio:.3g}x [{row.ci_low:.3g}, {row.ci_high:.3g}]")
    return lines


TABLE_WIDTH = 120  # the default table fits a terminal; --full prints every column


def _amount(value: float, unit: str) -> str:
    if value is None or not np.isfinite(value):
        return ""
    factor, name = unit_scale(value, unit)
    return f"{value / factor:.4g} {name}".rstrip()


def key_name(row, config: Mapping[str, Any] | None = None) -> str:
    """benchmark/case/variant/metric of a compared or tracked row; memory by module adds its module and role
    (`.../module_bytes encoder.layers.3 saved`), read from `config` (the row's own `config` by default)."""
    if config is None:
        text = getattr(row, CONFIG_COLUMN, None)
        config = json.loads(text) if isinstance(text, str) and text.startswith("{") else {}
    where = f" {config['module']} {config.get('role', '')}".rstrip() if "module" in config else ""
    return f"{row.benchmark}/{row.case}/{row.variant}/{row.metric}{where}"


def distinct_names(rows: pd.DataFrame) -> list[str]:
    """benchmark/case/variant/metric of each row (memory by module: with its module and role, `.../module_bytes
    encoder.layers.3 saved`), and where several rows share that, the settings of their configuration that tell
    them apart (`[n=512]`), so no two lines read alike."""
    configs = [{**{column: getattr(row, column) for column in ("dimension", "device", "dtype") if column in rows},
                **(json.loads(row.config) if isinstance(getattr(row, "config", None), str) and row.config.startswith("{")
                   else {})} for row in rows.itertuples()]
    names = [key_name(row, config) for row, config in zip(rows.itertuples(), configs)]
    for config in configs:  # in the name already
        config.pop("module", None), config.pop("role", None)
    shared: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        shared.setdefault(name, []).append(index)
    for indices in (indices for indices in shared.values() if len(indices) > 1):
        keys = sorted({key for index in indices for key in configs[index]})
        varying = [key for key in keys if len({json.dumps(configs[index].get(key), sort_keys=True) for index in indices}) > 1]
        for index in indices:
            settings = ", ".join(f"{key}={configs[index].get(key)}" for key in varying)
            names[index] += f" [{settings}]" if settings else ""
    return names


def compact_table(comparison: pd.DataFrame, width: int = TABLE_WIDTH) -> list[str]:
    """One line per metric, at most `width` columns: what (benchmark/case/variant/metric, and the settings
    that tell apart metrics of one name), A -> B medians in their unit, B/A with its 95% interval, and the
    label; a name too long for its column gets a line of its own, never cut. The lines most worth reading
    come first (worse, better, noisy, inconclusive, then the rest). Under an inconclusive or noisy line,
    one more says how each side's trials stopped, where the runs recorded it."""
    order = {label: index for index, label in enumerate((WORSE, BETTER, NOISY, INCONCLUSIVE, SAME, NO_DIRECTION))}
    rows = comparison.assign(_order=comparison["label"].map(order)).sort_values("_order", kind="stable")
    cells = [(name,
              f"{_amount(row.median_a, row.unit)} -> {_amount(row.median_b, row.unit)}",
              "" if not np.isfinite(row.ratio) else f"{row.ratio:.3g}x [{row.ci_low:.3g}, {row.ci_high:.3g}]",
              str(row.label)) for name, row in zip(distinct_names(rows), rows.itertuples())]
    notes = [f"    trials stopped: {row.stopped}"[:width] if row.label in (INCONCLUSIVE, NOISY) and row.stopped else ""
             for row in rows.itertuples()]
    amount_width = max((len(amounts) for _, amounts, _, _ in cells), default=0)
    ratio_width = max((len(ratio) for _, _, ratio, _ in cells), default=0)
    label_width = max((len(label) for *_, label in cells), default=0)
    name_width = max(20, min(max((len(name) for name, *_ in cells), default=0),
                             width - amount_width - ratio_width - label_width - 6))
    lines = []
    for (name, amounts, ratio, label), note in zip(cells, notes):
        figures = f"{amounts:>{amount_width}}  {ratio:<{ratio_width}}  {label}".rstrip()
        if len(name) <= name_width:
            lines.append(f"{name:<{name_width}}  {figures}")
        else:  # the name whole on its own line(s), its figures indented under it
            lines += [*textwrap.wrap(name, width, subsequent_indent="  "), f"    {figures}"]
        lines += [note] if note else []
    return lines


def machine_drift(comparison: pd.DataFrame, yardsticks: Iterable[str]) -> str | None:
    """One line on how much the machine itself moved between the runs: the median and range of the
    timings' B/A of the `yardsticks` (benchmarks that measure the machine, not the code: `registry.yardsticks`;
    rates inverted, so above 1 means B's machine was slower), or None when either run lacks them."""
    yardsticks = list(yardsticks)
    rows = comparison[comparison["benchmark"].isin(yardsticks) & comparison[UNIT_COLUMN].isin(TIMED_UNITS)
                      & ~comparison[METRIC_NAME].str.contains("gc_") & comparison["ratio"].notna()]
    if rows.empty:
        return None
    slowdown = np.where(rows[UNIT_COLUMN] == "s", rows["ratio"], 1 / rows["ratio"])
    return (f"machine drift: {', '.join(sorted(set(rows['benchmark'])))} took {np.median(slowdown):.2f}x as long in B as in A (median of "
            f"{len(rows)}, range {slowdown.min():.2f}-{slowdown.max():.2f}x); timing ratios within that "
            f"range are the machine's sitting, not the code")


def any_worse(comparison: pd.DataFrame) -> bool:
    """Whether any metric is significantly worse beyond the threshold (the CI gate)."""
    return bool((comparison["label"] == WORSE).any())


def stops_by_variant(records) -> dict[tuple[str, str, str], str]:
    """From a run's records: (benchmark, case, variant) -> "N trials, reason" of its `trials_run` record."""
    rows = records[records["metric"] == TRIALS_RUN]
    return {(row.benchmark, row.case, row.variant):
            f"{int(row.value)} trial{'' if row.value == 1 else 's'}, {json.loads(row.params)['stop']}"
            for row in rows.itertuples()}
