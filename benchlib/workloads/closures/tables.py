"""The notebook's tables from the records: the seed's table, verdicts per pair, the tracker's floor."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from benchlib.engines.gradients import GRAD_ERROR_METRIC
from benchlib.analysis.stats import DEFAULT_ALPHA, DEFAULT_MIN_EFFECT, compare_counts, compare_times
from benchlib.workloads.closures.spec import (
    NAME, ORDERS, STEPS, PHASES, PAIRS, VALID_ENGINES, GRADS_IDENTICAL, NOT_APPLICABLE,
)


def expand_cases(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame's engine rows of this benchmark with mwe, order and step from their params."""
    rows = frame[(frame["benchmark"] == NAME) & (frame["dimension"] == "engine")]
    params = rows["params"].map(json.loads)
    return rows.assign(engine=rows["variant"], **{name: params.map(lambda p, name=name: p[name])
                                                  for name in ("mwe", "order", "step")})


def _values(group: pd.DataFrame, metric: str) -> np.ndarray:
    return group.loc[group["metric"] == metric, "value"].to_numpy()


def _median(values: np.ndarray) -> float:
    return float(np.median(values)) if values.size else math.nan


def _floor(values: np.ndarray) -> float:
    return float(np.min(values)) if values.size else math.nan


def _spread(values: np.ndarray) -> float:
    return float(np.ptp(values)) if values.size else math.nan


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _phase_columns(group: pd.DataFrame, phase: str, unit: str, scale: float, low: tuple, high: tuple) -> dict:
    """One phase's columns: allocation floor and range, bytes floor, median time with a low and high percentile."""
    counts, times = _values(group, f"{phase}_alloc_count"), _values(group, f"{phase}_time")
    python = _values(group, f"{phase}_alloc_count_python")
    return {f"{phase} allocs": _floor(counts), f"{phase} allocs range": _spread(counts),
            f"{phase} bytes": _floor(_values(group, f"{phase}_alloc_bytes")),
            f"{phase} python allocs": _floor(python), f"{phase} python allocs range": _spread(python),
            f"{phase} time ({unit})": scale * _median(times),
            **{f"{phase} time {name} ({unit})": scale * _percentile(times, q) for name, q in (low, high)}}


def seed_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The seed's table: per MWE, order, engine and step, allocations, bytes and times, cold and warm.

    Allocations and bytes are floors over identical calls (see `benchlib.analysis.stats.compare_counts`), with
    their range; times are medians with quartiles (warm) or min and max over passes (cold)."""
    rows = []
    expanded = expand_cases(frame)
    expanded = expanded[expanded["step"].isin(STEPS)]
    for (mwe, order, engine, step), group in expanded.groupby(["mwe", "order", "engine", "step"], sort=False):
        if (group["metric"] == NOT_APPLICABLE).any():
            reason = json.loads(group["params"].iloc[0]).get("message", "")
            rows.append({"mwe": mwe, "order": order, "engine": engine, "step": step, "not applicable": reason})
            continue
        setup = json.loads(group["params"].iloc[0]).get("setup", "")
        row = {"mwe": mwe, "order": order, "engine": engine, "step": step, "setup": setup,
               **_phase_columns(group, "warm", "µs", 1e6, ("q25", 25), ("q75", 75)),
               **_phase_columns(group, "cold", "ms", 1e3, ("min", 0), ("max", 100)),
               GRAD_ERROR_METRIC: _median(_values(group, GRAD_ERROR_METRIC))}
        compiles = _values(group, "cold_compiles")
        if compiles.size:
            row |= {"compiles (cold)": _median(compiles),
                    "compiles (warm)": _median(_values(group, "warm_compiles")),
                    "recompiles": _median(_values(group, "recompiles")),
                    "cache entries": _median(_values(group, "cache_entries"))}
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    order_rank = {name: i for i, name in enumerate(ORDERS)}
    engine_rank = {name: i for i, name in enumerate(VALID_ENGINES)}
    table["step"] = pd.Categorical(table["step"], categories=STEPS, ordered=True)
    keys = table.assign(_order=table["order"].map(order_rank), _engine=table["engine"].map(engine_rank))
    return (keys.sort_values(["mwe", "_order", "_engine", "step"], kind="stable")
            .drop(columns=["_order", "_engine"]).reset_index(drop=True))


def verdict_table(frame: pd.DataFrame, *, alpha: float = DEFAULT_ALPHA,
                  min_effect: float = DEFAULT_MIN_EFFECT) -> pd.DataFrame:
    """A verdict per pair of steps (PAIRS), phase, engine, order and MWE: allocation counts (system
    and, where traced, Python-allocator) and bytes against the tracker's jitter, times by Mann-Whitney U (p < alpha and a min_effect change),
    and whether the two states' gradients are bit-identical."""
    rows = []
    expanded = expand_cases(frame)
    for (mwe, order, engine), group in expanded.groupby(["mwe", "order", "engine"], sort=False):
        if (group["metric"] == NOT_APPLICABLE).any():
            continue
        by_step = {step: rows_ for step, rows_ in group.groupby("step")}
        for phase in PHASES:
            for a, b in PAIRS[phase]:
                if a not in by_step or b not in by_step:
                    continue
                row = {"mwe": mwe, "order": order, "engine": engine, "phase": phase, "pair": f"{a} vs {b}"}
                for quantity, label in (("count", "allocs"), ("bytes", "bytes"), ("count_python", "python allocs")):
                    metric = f"{phase}_alloc_{quantity}"
                    sample_a, sample_b = _values(by_step[a], metric), _values(by_step[b], metric)
                    if not (sample_a.size and sample_b.size):
                        continue
                    jitter = None
                    if phase == "cold":  # few first calls: widen by what identical warm calls of both show
                        warm = [_values(by_step[s], f"warm_alloc_{quantity}") for s in (a, b)]
                        jitter = max([np.ptp(v) for v in warm if v.size] + [np.ptp(sample_a), np.ptp(sample_b)])
                    verdict = compare_counts(sample_a, sample_b, jitter=jitter)
                    row |= {f"{label} a": verdict.floor_a, f"{label} b": verdict.floor_b,
                            f"{label} jitter": verdict.jitter, f"{label} verdict": verdict.verdict}
                times_a, times_b = _values(by_step[a], f"{phase}_time"), _values(by_step[b], f"{phase}_time")
                if times_a.size and times_b.size:
                    verdict = compare_times(times_a, times_b, alpha=alpha, min_effect=min_effect)
                    row |= {"time ratio b/a": verdict.ratio, "p": verdict.p_value, "time verdict": verdict.verdict}
                pair = by_step.get(f"{a} vs {b}")
                if pair is not None:
                    identical_values = _values(pair, GRADS_IDENTICAL)
                    if identical_values.size:
                        row["grads identical"] = bool(identical_values[0] == 1.0)
                if "allocs verdict" in row or "time verdict" in row:
                    rows.append(row)
    return pd.DataFrame(rows)


def differing_pairs(verdicts: pd.DataFrame) -> pd.DataFrame:
    """The rows of `verdict_table` where allocations, bytes or time differ."""
    columns = [c for c in ("allocs verdict", "bytes verdict", "python allocs verdict", "time verdict") if c in verdicts]
    if not columns:
        return verdicts.iloc[0:0]
    return verdicts[(verdicts[columns] == "differ").any(axis=1)]


def tracker_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The tracker's counts (system, Python; its floor subtracted) and bytes for an empty call: median and range
    over samples."""
    rows = frame[(frame["benchmark"] == NAME) & (frame["dimension"] == "tracker")]
    return (rows.groupby(["device", "metric"])["value"].agg(["median", "min", "max", "count"]).reset_index())
