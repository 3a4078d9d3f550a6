"""Summaries derived from stored raw values, never stored themselves: a training cell's records hold
its per-step times, GC pauses and losses, and its median, p99, throughput and GC share follow from
them here, so a reader of any run (and `benchlib compare`, the seed verdicts) sees them alike."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

STEP_METRICS = {"step_time", "step_gc_time", "step_gc_pauses", "step_loss"}
MEMORY_STEP_METRICS = {"step_memory": "step_memory_max", "step_cycle_bytes": "cycle_bytes_max"}  # where stored
STEP_SUMMARIES = {  # derived metric -> unit
    "step_time_median": "s", "step_time_p99": "s", "step_time_max": "s", "throughput": "model-samples/s",
    "gc_share": "", "gc_pauses": "count", "step_gc_time_max": "s", "final_loss": "",
    "step_memory_max": "B", "cycle_bytes_max": "B",
}
_CELL = ["benchmark", "case", "dimension", "variant", "device", "dtype", "params"]


def step_summaries(steps: dict[str, np.ndarray], *, warmup: int, samples_per_step: int) -> dict[str, float]:
    """The summary of one cell from its per-step arrays (warm-up steps included, dropped here);
    throughput counts every timed second. The memory maxima come with the per-step memory, where
    it was stored (runs before it was have none)."""
    times, gc_time = steps["step_time"][warmup:], steps["step_gc_time"][warmup:]
    total = float(times.sum())
    memory = {summary: float(steps[metric][warmup:].max()) for metric, summary in MEMORY_STEP_METRICS.items()
              if metric in steps}
    return memory | {
        "step_time_median": float(np.median(times)),
        "step_time_p99": float(np.percentile(times, 99)),
        "step_time_max": float(times.max()),
        "throughput": samples_per_step * len(times) / total,
        "gc_share": float(gc_time.sum()) / total,
        "gc_pauses": float(steps["step_gc_pauses"][warmup:].sum()),
        "step_gc_time_max": float(gc_time.max()),
        "final_loss": float(steps["step_loss"][-1]),
    }


def with_step_summaries(records: pd.DataFrame) -> pd.DataFrame:
    """`records` plus the `STEP_SUMMARIES` rows of every cell that stored its steps (params name the
    cell's `warmup`, `n_nets` and `batch`). Summary rows an older run stored are replaced where the
    steps are there to derive them, kept where they are not."""
    is_step = records["metric"].isin(STEP_METRICS | MEMORY_STEP_METRICS.keys())
    if not is_step.any():
        return records
    derived = []
    for cell, rows in records[is_step].groupby(_CELL, sort=False, dropna=False):
        by_metric = {m: r.sort_values("repeat")["value"].to_numpy(float) for m, r in rows.groupby("metric")}
        params = json.loads(cell[-1])
        if not STEP_METRICS <= set(by_metric) or len(by_metric["step_time"]) <= params["warmup"]:
            continue
        first = rows.iloc[0]
        summary = step_summaries(by_metric, warmup=params["warmup"], samples_per_step=params["n_nets"] * params["batch"])
        derived += [{**first.to_dict(), "metric": metric, "value": value, "unit": STEP_SUMMARIES[metric], "repeat": 0}
                    for metric, value in summary.items()]
    if not derived:
        return records
    derived = pd.DataFrame(derived, columns=records.columns).astype(records.dtypes.to_dict())
    cells_derived = set(map(tuple, derived[_CELL].astype(str).to_numpy()))
    stored_summary = records["metric"].isin(STEP_SUMMARIES.keys())
    replaced = stored_summary & records[_CELL].astype(str).apply(tuple, axis=1).isin(cells_derived)
    return pd.concat([records[~replaced], derived], ignore_index=True)
