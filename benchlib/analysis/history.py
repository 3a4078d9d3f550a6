"""When did a figure step? Each headline metric over many runs, its change points and their size.

`benchlib compare` answers for two runs; a history answers for a row of them, ordered by the commit
measured: one point per run (the median of its trials), keyed as `compare` keys a metric. Change
points come from `ruptures` (PELT, least squares) on the medians in units of the runs' own trial
noise, so a series that only wobbles as its trials do has none; every change point is then checked
as `compare` would check two runs: the trials of the runs before it against those after it, a ratio
of medians with a 95% interval that must exclude 1 and move by more than the threshold.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchlib.errors import Refused
from benchlib.analysis.compare import (CONFIG_COLUMN, CONTEXT_METRICS, KEY_COLUMNS, lower_is_better,
                                      UNIT_COLUMN, VALUE_COLUMN, distinct_names, key_name, trial_values, with_config)
from benchlib.analysis.derived import with_step_summaries
from benchlib.units import unit_scale
from benchlib.analysis.stats import BETTER, WORSE, ratio_of_medians
from benchlib.records.store import RecordsUnreadable, list_runs, load_records, load_run_info, resolve_run

BY_COMMIT, BY_TIME = "commit", "time"
MIN_RUNS = 3  # a step needs a run on one side and a run to tell it from noise on the other
HOST_COLUMN = "host"  # the machine a run measured on: one series per machine, so a change of machine is no step
SERIES_COLUMNS = [*KEY_COLUMNS, UNIT_COLUMN, CONFIG_COLUMN, HOST_COLUMN]
# PELT's penalty per change point, in units of the scaled medians' variance, times log(points) (BIC-like):
# on medians of pure noise at one trial sigma it fires in under 5% of series of 8 or more points, and the
# interval check after it removes most of those.
PENALTY_PER_LOG_POINT = 3.0
NOISE_CONFIDENCE = 0.95  # the noise scale is the trials' standard deviation at this upper bound
STEP_COLUMNS = [*SERIES_COLUMNS, "from_run", "to_run", "from_commit", "to_commit", "to_started_at", "runs_before",
                "runs_after", "median_before", "median_after", "ratio", "ci_low", "ci_high", "label", "latest"]


class HistoryError(Refused):
    """Input a history cannot be told from; the message says what to give instead."""


@dataclass(frozen=True)
class History:
    """The records of the runs read (with `run_id`, `started_at` and `commit` per row), the
    benchmarks' headline metrics as run.json keeps them, a message per run that was skipped, and
    each run's directory by its id; `unreadable` counts the skipped runs whose files could not be
    read (a failure to report, where a run without records is not)."""

    records: pd.DataFrame
    headlines: dict[str, list[str]]
    skipped: list[str]
    paths: dict[str, Path]
    unreadable: int = 0


def point_commit(info: Mapping[str, Any], benchmark: str, case: str) -> str | None:
    """The commit a run measured for one benchmark: a model file's own repository's commit (the file
    is the code under test), else benchlib's checkout; short, with `-dirty` for uncommitted changes."""
    files = info.get("model_files") or {}
    entry = files.get(f"{benchmark}/{case}") or files.get(benchmark)
    git = (entry if entry is not None else info.get("environment") or {}).get("git") or {}
    commit = git.get("commit")
    if not commit:
        return None
    return commit[:7] + ("-dirty" if git.get("dirty") else "")


def read_history(runs: Sequence[str | os.PathLike] = (), root: str | os.PathLike | None = None) -> History:
    """The records of `runs` (ids under `root` or directories), or of every run under `root`. A run
    whose run.json or records cannot be read, or that holds no records, is skipped with a message; so is a
    second directory of one run id (a copy), counted once.
    Training cells' step summaries are derived here, run by run (a cell is named within its run)."""
    if runs:
        try:
            paths = [resolve_run(run, root) for run in runs]
        except FileNotFoundError as missing:
            raise HistoryError(str(missing)) from None
    else:
        try:
            paths = [Path(path) for path in list_runs(root)["path"]]
        except FileNotFoundError as missing:
            raise HistoryError(f"{missing} (--out names the directory that holds runs)") from None
    frames, headlines, skipped, run_paths, unreadable = [], {}, [], {}, 0
    for path in paths:
        try:
            info = load_run_info(path)
            records = with_step_summaries(load_records(path)).dropna(subset=[VALUE_COLUMN])
        except (FileNotFoundError, RecordsUnreadable) as error:
            skipped.append(f"{path}: unreadable: {error}")
            unreadable += 1
            continue
        if records.empty:
            skipped.append(f"{path}: no records")
            continue
        for name, declared in (info.get("benchmarks") or {}).items():
            headlines.setdefault(name, [])
            headlines[name] += [m for m in declared.get("headline") or () if m not in headlines[name]]
        run_id = info.get("run_id") or path.name
        if run_id in run_paths:  # a copied run directory: the same run, counted once, its copy named
            skipped.append(f"{path}: a copy of run {run_id} (also at {run_paths[run_id]}): counted once")
            continue
        commits = {key: point_commit(info, *key) for key in set(zip(records["benchmark"], records["case"]))}
        run_paths[run_id] = path
        frames.append(records.assign(run_id=info.get("run_id") or path.name, started_at=info.get("started_at"),
                                     host=machine(info),
                                     commit=[commits[key] for key in zip(records["benchmark"], records["case"])]))
    return History(pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(), headlines, skipped, run_paths,
                   unreadable)


def machine(info: Mapping[str, Any]) -> str:
    """The machine a run measured on, by its hardware (CPU model, and the GPUs where any): stable where
    host names are not (CI runners and containers get a new one each run); "" where run.json says none."""
    environment = info.get("environment") if isinstance(info.get("environment"), dict) else {}
    cpu = environment.get("cpu") if isinstance(environment.get("cpu"), dict) else {}
    gpu = environment.get("gpu") if isinstance(environment.get("gpu"), dict) else {}
    gpus = [str(device.get("name")) for device in gpu.get("devices") or () if isinstance(device, dict)]
    return " + ".join(part for part in (str(cpu.get("model") or ""), ", ".join(gpus)) if part)


def judged(records: pd.DataFrame) -> pd.Series:
    """Rows of metrics with a better direction that describe a result, not its context."""
    directed = [lower_is_better(metric, unit) is not None for metric, unit in zip(records["metric"], records[UNIT_COLUMN])]
    return pd.Series(directed, index=records.index, dtype=bool) & ~records["metric"].isin(CONTEXT_METRICS)


def build_series(records: pd.DataFrame, *, headlines: Mapping[str, Sequence[str]] | None = None,
                 benchmarks: Sequence[str] = (), metrics: Sequence[str] = (), by: str = BY_COMMIT) -> pd.DataFrame:
    """One row per series and run: the series' key (`SERIES_COLUMNS`), `run_id`, `started_at`, `commit`,
    `trials` (the run's values, `trial_values`) and their `median`, with `position` its place in the series.

    `records` hold `run_id`, `started_at`, `commit` and `host` per row (`read_history`: the `machine`, by
    its hardware); each machine is a series of its own (a second machine at one commit is not a step),
    named in the series' name only where the history spans several. A benchmark's series are
    its `headlines` metrics, or every judged metric where none are known, or `metrics` when given. `by`
    commit puts the runs of one commit together, commits in the order of their first run (a run without a
    recorded commit, made outside git, stands alone at its start time: `without_commit` names them); by
    time, runs by start alone. Unknown names are refused."""
    if by not in (BY_COMMIT, BY_TIME):
        raise HistoryError(f"--by must be {BY_COMMIT} or {BY_TIME}, got {by!r}")
    records = records[judged(records)]
    if HOST_COLUMN not in records:  # records of one unnamed machine
        records = records.assign(**{HOST_COLUMN: ""})
    for column, names in (("benchmark", benchmarks), ("metric", metrics)):  # a typo must not read as "no step"
        held = sorted(set(records[column]))
        unknown = [name for name in names if name not in held]
        if unknown:
            judged_note = " (with a better direction)" if column == "metric" else ""
            raise HistoryError(f"unknown {column} {', '.join(unknown)}; the runs hold{judged_note}: "
                               f"{', '.join(held) or 'none'}")
        if names:
            records = records[records[column].isin(names)]
    if not metrics and headlines:
        chosen = records["benchmark"].map(lambda name: list(headlines.get(name) or ()))
        records = records[[not wanted or metric in wanted for metric, wanted in zip(records["metric"], chosen)]]
    rows = []
    for key, group in with_config(records).groupby(SERIES_COLUMNS, sort=True):
        for (run_id, started_at), run_rows in group.groupby(["run_id", "started_at"], sort=False, dropna=False):
            values = trial_values(run_rows)
            rows.append([*key, run_id, started_at, run_rows["commit"].iloc[0], values, float(np.median(values))])
    series = pd.DataFrame(rows, columns=[*SERIES_COLUMNS, "run_id", "started_at", "commit", "trials", "median"])
    series["started"] = pd.to_datetime(series["started_at"], utc=True, errors="coerce")
    if by == BY_COMMIT:  # a run without a commit is a group of its own, so it falls at its own start time
        group = series["commit"].where(series["commit"].notna(), "run " + series["run_id"])
        series["commit_started"] = series.groupby([*SERIES_COLUMNS, group])["started"].transform("min")
        order = [*SERIES_COLUMNS, "commit_started", "started", "run_id"]
    else:
        order = [*SERIES_COLUMNS, "started", "run_id"]
    series = series.sort_values(order, kind="stable").drop(columns=["commit_started"], errors="ignore")
    series["position"] = series.groupby(SERIES_COLUMNS).cumcount()
    if series[HOST_COLUMN].nunique() < 2:  # one machine: nothing to tell apart, no host in the names
        series[HOST_COLUMN] = ""
    return series.reset_index(drop=True)


def without_commit(series: pd.DataFrame) -> list[str]:
    """The runs of `series` with no recorded commit (made outside a git repository): ordered by start time."""
    return sorted(set(series.loc[series["commit"].isna(), "run_id"]))


def noise_scale(trials: Sequence[np.ndarray], medians: np.ndarray, threshold: float) -> float:
    """The unit the medians are measured in for change points: the pooled standard deviation of the
    trials within each run (its upper 95% bound: two trials a run estimate it poorly, and a low guess
    reads luck as a step), floored at half the threshold times the series' level, so that counts and
    bytes with no spread at all still have a scale and a step just past the threshold stands out."""
    from scipy.stats import chi2

    deviations = [np.asarray(values) - np.mean(values) for values in trials if len(values) > 1]
    freedom = sum(len(values) - 1 for values in deviations)
    squares = sum(float(np.sum(d * d)) for d in deviations)
    pooled = math.sqrt(squares / chi2.ppf(1 - NOISE_CONFIDENCE, freedom)) if freedom else 0.0
    return max(pooled, threshold / 2 * abs(float(np.median(medians))))


def change_points(medians: np.ndarray, scale: float) -> list[int]:
    """Positions where a new segment starts, by PELT on the medians in units of `scale`."""
    import ruptures as rpt

    if scale <= 0 or len(medians) < 2:
        return []
    signal = (np.asarray(medians, float) / scale).reshape(-1, 1)
    penalty = PENALTY_PER_LOG_POINT * max(math.log(len(medians)), 1.0)
    return rpt.Pelt(model="l2", min_size=1, jump=1).fit(signal).predict(pen=penalty)[:-1]


def _step(points: pd.DataFrame, start: int, at: int, end: int, threshold: float) -> dict[str, Any] | None:
    """The step at `at` between segments [start, at) and [at, end): the ratio after/before of the
    pooled trials' medians with its interval; None where it cannot be judged (a side holds one value: its
    interval would have no width, and noise would read as a step) or is not one (its interval holds 1, or
    it is within the threshold)."""
    before = np.concatenate(points["trials"].iloc[start:at].tolist())
    after = np.concatenate(points["trials"].iloc[at:end].tolist())
    if min(before.size, after.size) < 2:  # one measurement on a side (a fit's point): no interval, so no step
        return None
    if not (np.all(before > 0) and np.all(np.isfinite(after))):
        return None  # zero before (no GC pause, no allocation): no ratio to take
    interval = ratio_of_medians(before, after)
    if interval.ci_low <= 1 <= interval.ci_high or abs(interval.ratio - 1) <= threshold:
        return None
    last, first = points.iloc[at - 1], points.iloc[at]
    lower = lower_is_better(first["metric"], first[UNIT_COLUMN])
    return {**{column: first[column] for column in SERIES_COLUMNS}, "from_run": last["run_id"],
            "to_run": first["run_id"], "from_commit": last["commit"], "to_commit": first["commit"],
            "to_started_at": first["started_at"], "runs_before": at - start, "runs_after": end - at,
            "median_before": float(np.median(before)), "median_after": float(np.median(after)),
            "ratio": interval.ratio, "ci_low": interval.ci_low, "ci_high": interval.ci_high,
            "label": WORSE if (interval.ratio > 1) == lower else BETTER,
            "position": at}


def series_steps(points: pd.DataFrame, threshold: float) -> list[dict[str, Any]]:
    """The confirmed steps of one series (rows of `build_series`, in order). A change point that fails
    its check is dropped, the weakest (smallest jump between its two runs) first, and its neighbours
    judged again over the merged segments."""
    medians = points["median"].to_numpy(float)
    points_at = change_points(medians, noise_scale(points["trials"].tolist(), medians, threshold))
    while True:
        bounds = [0, *points_at, len(points)]
        steps = [_step(points, bounds[i - 1], bounds[i], bounds[i + 1], threshold) for i in range(1, len(bounds) - 1)]
        failed = [(abs(medians[at] - medians[at - 1]), at) for at, step in zip(points_at, steps) if step is None]
        if not failed:
            return steps
        points_at.remove(min(failed)[1])


def find_steps(series: pd.DataFrame, *, threshold: float) -> pd.DataFrame:
    """Every confirmed step of every series with `MIN_RUNS` runs or more (`STEP_COLUMNS`, plus the step's
    `position`); `latest` marks each series' last step, whose label decides the exit status."""
    if not 0 < threshold < 1:
        raise HistoryError(f"--threshold must lie in (0, 1) (a relative change, 0.05 = 5%; it also floors the "
                           f"noise scale), got {threshold!r}")
    rows = []
    for _, points in series.groupby(SERIES_COLUMNS, sort=True):
        if len(points) >= MIN_RUNS:
            steps = series_steps(points.reset_index(drop=True), threshold)
            rows += [{**step, "latest": index == len(steps) - 1} for index, step in enumerate(steps)]
    return pd.DataFrame(rows, columns=[*STEP_COLUMNS, "position"])


def looked_at(series: pd.DataFrame) -> pd.DataFrame:
    """The series with `MIN_RUNS` runs or more: those a step can be found in."""
    sizes = series.groupby(SERIES_COLUMNS)["run_id"].transform("size")
    return series[sizes >= MIN_RUNS]


def latest_regressions(steps: pd.DataFrame) -> pd.DataFrame:
    """The series whose latest step is worse: the exit status's 1."""
    return steps[steps["latest"] & (steps["label"] == WORSE)]


def series_name(row: Any) -> str:
    """benchmark/case/variant/metric, the way `compare` names a metric (`key_name`), and the host where the
    history spans several (`build_series` keeps it only then)."""
    host = getattr(row, HOST_COLUMN, "")
    return key_name(row) + (f" on {host}" if host else "")


def ended_series(series: pd.DataFrame) -> list[str]:
    """The series of a benchmark the latest run measured that the latest run does not hold (a module, engine or
    metric renamed or gone since): their history ends before it, so no step of theirs is judged at the latest run."""
    latest = series.sort_values("started").iloc[-1]["run_id"]
    measured = set(series.loc[series["run_id"] == latest, "benchmark"])
    ended = pd.DataFrame([group.iloc[0] for _, group in series.groupby(SERIES_COLUMNS, sort=True, dropna=False)
                          if group["benchmark"].iloc[0] in measured and latest not in set(group["run_id"])])
    if ended.empty:
        return []
    hosts = [getattr(row, HOST_COLUMN, "") for row in ended.itertuples()]  # series of one name told apart, as
    return [name + (f" on {host}" if host else "") for name, host in zip(distinct_names(ended), hosts)]  # compare does


def format_value(value: float, unit: str) -> str:
    """A value in a readable scale of its unit (`unit_scale`)."""
    factor, name = unit_scale(value, unit)
    return f"{value / factor:.3g} {name}".rstrip()


def answer(steps: pd.DataFrame, series: pd.DataFrame) -> str:
    """The one line before the table: how many steps in how many series over how many runs, and
    whether a latest step is a regression (the worst one named)."""
    counted = looked_at(series)
    n_series = counted.groupby(SERIES_COLUMNS).ngroups
    scope = f"in {n_series} series over {counted['run_id'].nunique()} runs"
    if steps.empty:
        return f"no step {scope}"
    head = f"{len(steps)} step{'s' if len(steps) != 1 else ''} {scope}"
    regressions = latest_regressions(steps)
    if regressions.empty:
        return f"{head}; no latest step is a regression"
    worst = regressions.assign(distance=np.abs(np.log(regressions["ratio"]))).sort_values("distance").iloc[-1]
    more = f" (and {len(regressions) - 1} more series)" if len(regressions) > 1 else ""
    return (f"{head}; latest step in {series_name(worst)} is a regression: {worst.ratio:.3g}x "
            f"[{worst.ci_low:.3g}, {worst.ci_high:.3g}] at run {worst.to_run} (commit {worst.to_commit}){more}")
