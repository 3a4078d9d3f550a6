"""The memory/time frontier of a model file's engines: per engine its peak and its time per step, each a
median with a 95% interval over trials, and which engines no other beats on both (the Pareto set). Read
as the answer to "which technique gets my step under N bytes, and at what cost in time?": for a memory
level, the fastest engine that fits is the frontier engine with the largest peak at or under it."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from benchlib.analysis.compare import trial_values_by
from benchlib.records.metrics import GRAD_UNCHECKED_METRIC
from benchlib.analysis.stats import median_interval
from benchlib.units import format_bytes

TRACKED = "tracked_peak_bytes"  # the allocation pass's peak: byte-exact, the same for the same code path
# Below this a step's resident peak counts 4 KiB pages and the heap glibc keeps (buffers under the 128 KiB
# mmap threshold are never returned) more than its tensors: the tracked peak decides there.
RESIDENT_RESOLUTION = 1_000_000
FRONTIER_COLUMNS = ["case", "engine", "peak_metric", "peak", "peak_low", "peak_high", "time", "time_low",
                    "time_high", "trials", "checked", "pareto"]


def deciding_peak(samples: dict) -> tuple[str, str]:
    """Which peak ranks the engines and makes the ratios, and the words that say so: the resident peak
    (what the process really held), unless an engine's resident peak sits below `RESIDENT_RESOLUTION`,
    where pages and the allocator's retained heap count more than the step's tensors; then the tracked
    peak (the allocators' own count, byte-exact), where every engine has one."""
    small = [engine for engine, metrics in samples.items() if not np.median(metrics["peak_bytes"]) >= RESIDENT_RESOLUTION]
    if small and all(TRACKED in metrics and np.all(metrics[TRACKED] > 0) for metrics in samples.values()):
        return TRACKED, f"tracked peak (resident < {format_bytes(RESIDENT_RESOLUTION)}: page resolution)"
    return "peak_bytes", "resident peak"


def median_with_interval(values: np.ndarray) -> tuple[float, float, float]:
    """The median and its 95% interval over trials (nan bounds for one trial: no interval)."""
    if values.size < 2:
        return float(np.median(values)), math.nan, math.nan
    interval = median_interval(values)
    return interval.ratio, interval.ci_low, interval.ci_high


def frontier_frame(records: pd.DataFrame) -> pd.DataFrame:
    """Per case (a version of the file) and engine that measured a step and did not fail: the deciding peak
    and the time per step with their intervals, whether its gradient was checked, and whether it is on the
    frontier (no other checked engine has a lower or equal peak and time, one of them lower; medians)."""
    rows = []
    trials = trial_values_by(records, ["case", "variant", "metric"])
    for case, of_case in records.groupby("case", sort=False):
        samples, checked = {}, {}
        for engine, group in of_case.groupby("variant", sort=False):
            if (group["metric"] == "failed").any():
                continue
            metrics = {metric: trials[case, engine, metric] for metric in sorted(group["metric"].unique())}
            if "time" in metrics and "peak_bytes" in metrics:
                samples[engine] = metrics
                checked[engine] = GRAD_UNCHECKED_METRIC not in metrics
        if not samples:
            continue
        peak_metric, _ = deciding_peak(samples)
        part = []
        for engine, metrics in samples.items():
            peak, peak_low, peak_high = median_with_interval(metrics[peak_metric])
            time, time_low, time_high = median_with_interval(metrics["time"])
            part.append([case, engine, peak_metric, peak, peak_low, peak_high, time, time_low, time_high,
                         int(metrics["time"].size), checked[engine], False])
        for row in part:
            row[-1] = row[-2] and not any(
                other is not row and other[-2] and other[3] <= row[3] and other[6] <= row[6]
                and (other[3] < row[3] or other[6] < row[6]) for other in part)
        rows += part
    return pd.DataFrame(rows, columns=FRONTIER_COLUMNS)
