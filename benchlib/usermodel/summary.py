"""The summary a model file's run opens with (either form): one line per engine (per version, when
several), then per engine each later version's peak over the first's; the same rows as its headline table."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from benchlib.engines.gradients import GRAD_ERROR_METRIC
from benchlib.engines.roles import GRADIENT_METRIC, SAVED_METRIC
from benchlib.units import format_bytes, format_seconds
from benchlib.records.metrics import COMPILE_COLUMN, COMPILE_METRIC, MODULE_METRIC
from benchlib.analysis.ranks import rank_table, ranks_words
from benchlib.analysis.modules import holder_words, largest_holder, module_table, module_totals
from benchlib.analysis.compare import trial_values_by
from benchlib.analysis.frontier import TRACKED, deciding_peak, frontier_frame, median_with_interval
from benchlib.report.page import SUMMARY_COLUMN
from benchlib.analysis.stats import noise_flags, ratio_of_medians
from benchlib.trials import DETERMINISTIC, GRAD_UNCHECKED_METRIC, MAX_TRIALS, PRECISION
from benchlib.usermodel.arrays import ARRAY_ENGINES
from benchlib.engines.techniques import BUILTIN, placement_of

ENGINE_WIDTH = max(map(len, (*BUILTIN, *ARRAY_ENGINES)))  # the engine column's least width (combinations widen it)

# The roles a step allocates (in the peak above the baseline), by the words a summary line uses.
STEP_ROLES = {SAVED_METRIC: "saved activations", GRADIENT_METRIC: "gradients"}
ORDER = {engine: index for index, engine in enumerate(dict.fromkeys((*BUILTIN, *ARRAY_ENGINES)))}  # either form's;
# combinations and a file's own techniques follow, in the order they ran
COLUMNS = ["version", "engine", "status", "trials", "peak_bytes", "peak_low", "peak_high", "peak_ratio", "peak_ratio_low",
           "peak_ratio_high", "tracked_peak_bytes", "stop", "largest_role", "largest_role_bytes", "largest_module",
           "largest_module_share", "time_s", "time_low", "time_high", COMPILE_COLUMN,
           GRAD_ERROR_METRIC, "peak_ratio_of", "peak_ratio_to", "reason", "fastest", SUMMARY_COLUMN]


def _ratio(best: np.ndarray, own: np.ndarray) -> tuple[float, float, float]:
    interval = ratio_of_medians(best, own)
    if min(best.size, own.size) < 2:
        return interval.ratio, math.nan, math.nan
    return interval.ratio, interval.ci_low, interval.ci_high


def _bracket(low: float, high: float, text) -> str:
    return "" if math.isnan(low) else f" [{text(low)}, {text(high)}]"


def _stop_text(group: pd.DataFrame) -> tuple[str, str]:
    """Why an engine's trials stopped (`trials_run`), as its reason and the words a line ends with."""
    stop = group[group["metric"] == "trials_run"]
    if stop.empty:
        return "", ""
    params = json.loads(stop["params"].iloc[0])
    reason, reached = params["stop"], params.get("precision_reached")
    within = "" if reached is None or not math.isfinite(reached) else f"±{100 * reached:.1f}%"
    words = {PRECISION: f"peak within {within}", DETERMINISTIC: "identical peaks",
             MAX_TRIALS: f"the cap{f', peak {within}' if within else ''}"}.get(reason, reason)
    count = int(stop["value"].iloc[0])
    return reason, f"  {count} trial{'' if count == 1 else 's'} ({words})"


def _noise_words(times: np.ndarray) -> str:
    """The noise flag beside a time: its trials spread too widely to read a difference from (`noise_flags`)."""
    flags = noise_flags(times) if times.size >= 2 else []
    return f" (noisy: {flags[0].split(' > ')[0]})" if flags else ""


def _unchecked_words(group: pd.DataFrame) -> str:
    """Why an engine's gradient was not compared, in a few words (its records hold the whole reason):
    not comparable (a stochastic step, its modules named), or no reference to compare with."""
    rows = group[group["metric"] == GRAD_UNCHECKED_METRIC]
    if not len(rows):
        return ""
    message, params = json.loads(rows["params"].iloc[0])["message"], json.loads(group["params"].iloc[0])
    if message.startswith("not comparable"):
        modules = params.get("stochastic_modules")
        return f"  grad not comparable (stochastic step{': ' + ', '.join(modules) if modules else ''})"
    return f"  grad not checked ({message})"


def _wrapped_words(group: pd.DataFrame) -> str:
    """What torch-checkpoint wrapped, from its records (none for other engines)."""
    params = json.loads(group["params"].iloc[0])
    if "checkpoint" not in params:
        return ""
    return f"  wrapped: {params['checkpoint']} ({params.get('checkpoint_segments', '?')} recomputed)"


def _whole_message(statuses: pd.DataFrame) -> str:
    """The message of an engine's first failed or not-applicable record, whole (the line keeps its first line;
    the report and the table keep all of it, so an error is never cut to its type)."""
    return json.loads(statuses["params"].iloc[0]).get("message", "").strip() if len(statuses) else ""


def _order(engine: str) -> tuple[int, int]:
    """One process first, then each parallel strategy's steps; within each, the registry's order (combinations and
    a file's own techniques after, in the order they ran)."""
    strategy, rest = placement_of(engine)
    return strategy, ORDER.get(rest, len(ORDER))


def _holder(totals: pd.DataFrame, case: str, engine: str) -> tuple[str, float, str]:
    """The module holding the most of `engine`'s memory by module, its share, and the summary line's words."""
    row = largest_holder(totals, case, engine)
    if row is None or not row["share"] > 0:
        return "", math.nan, ""
    return row["module"], float(row["share"]), f"  {holder_words(row)}"


def _held(metrics: dict) -> float:
    """What the engine's process held at its peak (baseline and peak, medians over trials); NaN without a baseline."""
    if "baseline_bytes" not in metrics:
        return math.nan
    return float(np.median(metrics["baseline_bytes"]) + np.median(metrics["peak_bytes"]))


def _version_rows(records: pd.DataFrame, samples: dict, prefix: str, width: int) -> list[dict]:
    """Per engine of one version: peak above the baseline with its 95% interval over trials, the tracked
    peak (the allocators' count, byte-exact), the ratio to the engine with the lowest peak (with interval),
    the step role that holds the most, the module that holds the most, time per step; or why it did not run.
    `summary` is the row as one line."""
    rows = []
    ranks = rank_table(records)
    on_ranks = set(ranks["engine"])  # their peaks stand on baselines of other sizes: compared by what ranks hold
    peak_metric, by = deciding_peak(samples)
    best = min((engine for engine in samples if engine not in on_ranks),
               key=lambda engine: np.median(samples[engine][peak_metric]), default=None)
    comparable = best is not None and bool(np.all(samples[best][peak_metric] > 0))
    # the array form measures no roles: its lines say nothing of them rather than "not measured" on each
    any_roles = any(role in metrics for metrics in samples.values() for role in STEP_ROLES)
    totals = module_totals(module_table(records))
    for engine, group in records.groupby("variant", sort=False):
        statuses = group[group["metric"].isin(["failed", "not_applicable", "not_run"])]
        if engine not in samples:
            rows.append(_unmeasured_row(engine, statuses, f"{prefix}{engine:<{width}}"))
            continue
        metrics = samples[engine]
        peak, low, high = median_with_interval(metrics["peak_bytes"])
        tracked = float(np.median(metrics[TRACKED])) if TRACKED in metrics else math.nan
        ratio, ratio_low, ratio_high = (_ratio(samples[best][peak_metric], metrics[peak_metric])
                                        if comparable and engine not in on_ranks else (math.nan, math.nan, math.nan))
        roles = {role: float(np.median(metrics[role])) for role in STEP_ROLES if role in metrics}
        role = max(roles, key=roles.get, default=None)
        time_s, time_low, time_high = median_with_interval(metrics["time"])
        error = float(np.max(metrics[GRAD_ERROR_METRIC])) if GRAD_ERROR_METRIC in metrics else math.nan
        compile_s = float(np.median(metrics[COMPILE_METRIC])) if COMPILE_METRIC in metrics else math.nan
        if engine in on_ranks:
            ratio_text = "per rank"
        elif not comparable:
            ratio_text = "lowest" if engine == best else "no ratio (the lowest peak is 0: below the resolution)"
        else:
            ratio_text = f"best by {by}" if engine == best else \
                f"{ratio:.2f}x{_bracket(ratio_low, ratio_high, '{:.2f}'.format)} the best" \
                + (" by tracked peak" if peak_metric == TRACKED else "")
        module, share, module_text = _holder(totals, group["case"].iloc[0], engine)
        role_text = (_role_words(roles, role) if any_roles else "") + module_text \
            + ranks_words(ranks, group["case"].iloc[0], engine, _held(metrics))
        stop, stop_words = _stop_text(group)
        reason = _whole_message(statuses)
        failure = reason.splitlines()[0] if reason else ""
        line = (f"{prefix}{engine:<{width}} peak +{format_bytes(int(peak))}{_bracket(low, high, lambda v: format_bytes(int(v)))}"
                + ("" if math.isnan(tracked) else f" (tracked {format_bytes(int(tracked))})")
                + f"  {ratio_text}{role_text}  {format_seconds(time_s)}{_bracket(time_low, time_high, format_seconds)}/step"
                + _noise_words(metrics["time"])
                + ("" if math.isnan(compile_s) else f" (compiled in {format_seconds(compile_s)}, apart)")
                + ("" if math.isnan(error) else f"  grad err {error:.1e}") + _unchecked_words(group) + stop_words
                + _wrapped_words(group) + (f"  FAILED: {failure}" if failure else ""))
        rows.append({"engine": engine, "status": "ok" if not len(statuses) else "partial",
                     "trials": int(metrics["time"].size), "peak_bytes": peak, "peak_low": low, "peak_high": high,
                     "peak_ratio": ratio, "peak_ratio_low": ratio_low, "peak_ratio_high": ratio_high,
                     "tracked_peak_bytes": tracked, "stop": stop, "largest_role": STEP_ROLES.get(role, ""), "largest_role_bytes": roles.get(role, math.nan),
                     "largest_module": module, "largest_module_share": share,
                     "time_s": time_s, "time_low": time_low, "time_high": time_high, COMPILE_COLUMN: compile_s,
                     GRAD_ERROR_METRIC: error,
                     "peak_ratio_of": "tracked peak" if peak_metric == TRACKED else "peak",
                     "peak_ratio_to": best if comparable else "",
                     "reason": reason, SUMMARY_COLUMN: line})
    return sorted(rows, key=lambda row: _order(row["engine"]))


def _unmeasured_row(engine: str, statuses: pd.DataFrame, label: str) -> dict:
    """The row of an engine none of whose trials was measured: its status (failed, not applicable, not run) and
    why, the line beginning with `label`."""
    status = statuses["metric"].iloc[0] if len(statuses) else "failed"
    reason = _whole_message(statuses)
    message = reason.splitlines()[0] if reason else ""
    return {"engine": engine, "status": status, "trials": 0, "reason": reason,
            SUMMARY_COLUMN: f"{label} {status.replace('_', ' ')}: {message}"}


def _role_words(roles: dict[str, float], role: str | None) -> str:
    """The step role that holds the most, in words, and which roles were not measured."""
    if not role:
        return "  roles not measured"
    unmeasured = [words for metric, words in STEP_ROLES.items() if metric not in roles]
    if unmeasured:
        return f"  {STEP_ROLES[role]} {format_bytes(int(roles[role]))} ({', '.join(unmeasured)} not measured)"
    return f"  mostly {STEP_ROLES[role]} ({format_bytes(int(roles[role]))})"


def _versus(samples: dict, version: str, baseline: str, width: int) -> list[dict]:
    """Per engine measured in both: `version`'s peak over `baseline`'s, with its 95% interval."""
    rows = []
    for engine in sorted((engine for engine in samples[baseline] if engine in samples[version]), key=_order):
        before, after = samples[baseline][engine]["peak_bytes"], samples[version][engine]["peak_bytes"]
        what = f"{version} vs {baseline}: {engine:<{width}} peak ratio"
        if not np.all(before > 0):
            rows.append({"version": f"{version} vs {baseline}", "engine": engine, "status": "comparison",
                         SUMMARY_COLUMN: f"{what}: none ({baseline}'s peak is 0: below the resolution)"})
            continue
        ratio, low, high = _ratio(before, after)
        rows.append({"version": f"{version} vs {baseline}", "engine": engine, "status": "comparison",
                     "trials": int(min(before.size, after.size)), "peak_ratio": ratio, "peak_ratio_low": low,
                     "peak_ratio_high": high,
                     SUMMARY_COLUMN: f"{what} {ratio:.2f}x{_bracket(low, high, '{:.2f}'.format)}"})
    return rows


def _frontier_rows(records: pd.DataFrame, version: str, prefix: str, width: int) -> list[dict]:
    """The answer to "which engine gets the step under a memory level, fastest?": the frontier engines
    (`frontier_frame`) from the lowest peak up, each the fastest of those that fit under its peak."""
    on_ranks = set(rank_table(records)["engine"])  # peaks above baselines of other sizes: not on one frontier
    every = frontier_frame(records[~records["variant"].isin(on_ranks)])
    if every.empty or every["engine"].nunique() < 2:  # (no engine with a checked gradient: no columns at all)
        return []
    frame = every[every["pareto"]].sort_values("peak")
    if frame.empty:
        return []
    by = "tracked" if frame["peak_metric"].iloc[0] == TRACKED else "resident"
    rows = [{"version": version, "status": "frontier",
             SUMMARY_COLUMN: f"{prefix}fastest within a memory level ({by} peak; engines whose gradient was checked):"}]
    for row in frame.itertuples():
        time = f"{format_seconds(row.time)}{_bracket(row.time_low, row.time_high, format_seconds)}/step"
        rows.append({"version": version, "status": "frontier", "trials": row.trials, "fastest": row.engine,
                     "peak_bytes": row.peak, "peak_low": row.peak_low, "peak_high": row.peak_high,
                     "time_s": row.time, "time_low": row.time_low, "time_high": row.time_high,
                     SUMMARY_COLUMN: f"{prefix}  up to {format_bytes(int(row.peak)):>10}: {row.engine:<{width}} {time}"})
    return rows


def summary_table(records: pd.DataFrame) -> pd.DataFrame:
    """The rows of every version (a case each; one version is case `step`) with its frontier (the fastest
    engine under each memory level), then each later version against the first, engine by engine."""
    versions = list(dict.fromkeys(records["case"]))
    samples, rows = {}, []
    width = max((ENGINE_WIDTH, *map(len, records["variant"].dropna().astype(str))))
    measured = records[records["metric"] != MODULE_METRIC]
    trials = trial_values_by(measured, ["case", "variant", "metric"])
    for version in versions:
        group = records[records["case"] == version]
        samples[version] = {}
        for engine, of_engine in measured[measured["case"] == version].groupby("variant", sort=False):
            metrics = {metric: trials[version, engine, metric] for metric in sorted(of_engine["metric"].unique())}
            if "time" in metrics and "peak_bytes" in metrics:
                samples[version][engine] = metrics
        prefix = f"{version}: " if len(versions) > 1 else ""
        rows += [{"version": version, **row} for row in _version_rows(group, samples[version], prefix, width)]
        rows += _frontier_rows(group, version, prefix, width)
    for version in versions[1:]:
        rows += _versus(samples, version, versions[0], width)
    return pd.DataFrame(rows, columns=COLUMNS)
