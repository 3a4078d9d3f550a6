"""A tanh RNN with shared weights over T steps: the fan-out benchmark of HIPS autograd #219.

The model and sizes are autograd's own `bench_rnn` (batch 16, hidden 1024, 50 steps, float32,
weights 0.01·N(0, 1)): h₀ = x, hₜ = tanh(hₜ₋₁·W + b), one logistic output per step,
logitₜ = hₜ·Wout + bout, and the loss is summed over all T outputs. The gradient is taken with
respect to all weights (W, b, Wout, bout), each of which is used T times: keeping every
contribution until the end costs T weight-sized buffers, accumulating in place costs one.
`manual` is hand-written backpropagation through time that stores the hidden states and pops them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from benchlib.engines import ENGINE_NAMES, get_engine
from benchlib.engines.comparison import EngineComparison, compare_engines
from benchlib.engines.gradients import save_gradient
from benchlib.engines.roles import memory_roles, role_gauge
from benchlib.measure import MALLOC_POLICIES, Case, mark

BENCHMARK = "rnn_fanout"
SEED_SIZES = {"batch": 16, "hidden": 1024, "T": 50}
TARGET = "benchlib.workloads.rnn:case"
WEIGHTS = ("W", "b", "Wout", "bout")
WEIGHT_ARGNUMS = (0, 1, 2, 3)


def make_data(batch: int, hidden: int, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """bench_rnn's arrays in `dtype`: weights and input 0.01·N(0, 1), labels 0 or 1 (drawn in float64,
    so both dtypes see the same numbers)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "W": 0.01 * rng.standard_normal((hidden, hidden)),
        "b": 0.01 * rng.standard_normal(hidden),
        "Wout": 0.01 * rng.standard_normal((hidden, 1)),
        "bout": 0.01 * rng.standard_normal(1),
        "x": 0.01 * rng.standard_normal((batch, hidden)),
        "label": (rng.random((batch, 1)) > 0.5).astype(np.float64),
    }
    return {name: array.astype(dtype) for name, array in arrays.items()}


def rnn_loss(xp, T: int):
    """Summed logistic loss of the T outputs, written once against `xp`; marks where backward begins."""

    def loss(W, b, Wout, bout, x, label):
        def step(state):
            h, total = state
            h = xp.tanh(xp.dot(h, W) + b)
            logit = xp.dot(h, Wout) + bout
            loss_t = xp.sum(logit * (1 - label) + xp.log(1 + xp.exp(-logit)))
            return h, loss_t if total is None else total + loss_t

        mark("forward")
        _, total = xp.chain(step, step((x, None)), T - 1)
        mark("backward")
        return total

    return loss


def manual_gradient(xp, T: int):
    """Backpropagation through time by hand: store the hidden states, pop them, accumulate in place."""

    def accumulate(total, contribution):
        if total is None:
            return contribution
        total += contribution
        return total

    def gradient(W, b, Wout, bout, x, label):
        mark("forward")
        hidden_states = [x]
        logits = []
        h = x
        for _ in range(T):
            h = xp.tanh(xp.dot(h, W) + b)
            hidden_states.append(h)
            logits.append(xp.dot(h, Wout) + bout)
        mark("backward")
        dW = db = dWout = dbout = carry = None
        for _ in range(T):
            h = hidden_states.pop()
            logit = logits.pop()
            dlogit = 1 / (1 + xp.exp(-logit)) - label
            dWout = accumulate(dWout, xp.dot(h.T, dlogit))
            dbout = accumulate(dbout, xp.sum(dlogit, axis=0))
            dh = xp.dot(dlogit, Wout.T)
            if carry is not None:
                dh += carry
            da = dh * (1 - h * h)
            dW = accumulate(dW, xp.dot(hidden_states[-1].T, da))
            db = accumulate(db, xp.sum(da, axis=0))
            carry = xp.dot(da, W.T)
        return dW, db, dWout, dbout

    return gradient


def buffer_sizes(batch: int, hidden: int, dtype: str, device, malloc: str) -> str:
    """The two buffer sizes the RNN's memory moves in, and on CPU which side of the malloc policy's
    mmap threshold each falls (below it, freed buffers can stay in the process's RSS)."""
    itemsize = np.dtype(dtype).itemsize
    threshold = MALLOC_POLICIES[malloc].get("MALLOC_MMAP_THRESHOLD_")  # None: glibc's dynamic threshold
    lines = []
    for what, size in (("one W-sized buffer (hidden²·itemsize)", hidden * hidden * itemsize),
                       ("one hidden state (batch·hidden·itemsize)", batch * hidden * itemsize)):
        where = ("" if device.kind != "cpu" or threshold is None else
                 f", {'at or above' if size >= int(threshold) else 'below'} the {malloc} mmap threshold "
                 f"({int(threshold) // 1024} KiB)")
        lines.append(f"{what}: {size / 1024:.1f} KiB{where}")
    return "\n".join(lines)


def memory_required_bytes(engine: str, batch: int, hidden: int, T: int, dtype: str) -> int:
    """What a case needs: the hidden states, and T copies of W and its kind when contributions are kept."""
    itemsize = np.dtype(dtype).itemsize
    weight = hidden * hidden * itemsize
    states = T * batch * hidden * itemsize * 8
    kept = T * weight if engine == "benchlib-deferred" else 0
    return int(6 * weight + states + kept)


def case(*, device, engine: str, batch: int, hidden: int, T: int, dtype: str, gradient_dir: str,
         seed: int = 0) -> Case:
    """One engine's gradient call, set up in the isolation child.

    The check saves the last call's gradients of (W, b, Wout, bout) to `gradient_dir`; the parent
    compares them with manual's.
    """
    chosen = get_engine(engine)
    arrays = {name: chosen.asarray(value, device) for name, value in make_data(batch, hidden, dtype, seed).items()}
    args = tuple(arrays[name] for name in (*WEIGHTS, "x", "label"))
    del arrays
    xp = chosen.namespace(device)
    gradient = chosen.gradient(rnn_loss(xp, T), WEIGHT_ARGNUMS, manual=manual_gradient(xp, T))

    def check(result) -> dict[str, float]:
        save_gradient(result, gradient_dir, engine)
        return memory_roles(chosen, gradient, lambda: gradient(*args), inputs=args)

    return Case(lambda: gradient(*args), check, roles=role_gauge(chosen, gradient, inputs=args))


def growth_per_step(records: pd.DataFrame) -> pd.DataFrame:
    """Per engine, the least-squares slope of peak memory and of median time against T, from the
    records of a sweep: the fan-out cost per step, measured. `peak_per_step_in_W` is the peak's
    slope in units of one W-sized buffer (hidden²·itemsize, from the records' params and dtype).
    Engines measured at fewer than two T values get NaN."""
    measured = records[records["metric"].isin(["peak_bytes", "time"])]
    params = measured["params"].map(json.loads)
    table = (measured.assign(T=params.map(lambda p: p["T"]), hidden=params.map(lambda p: p["hidden"]))
             .groupby(["variant", "dtype", "hidden", "T", "metric"], sort=False)["value"].median()
             .unstack("metric").reset_index())
    rows = []
    for (engine, dtype, hidden), group in table.groupby(["variant", "dtype", "hidden"], sort=False):
        enough = group["T"].nunique() >= 2
        peak_slope = float(np.polyfit(group["T"], group["peak_bytes"], 1)[0]) if enough else math.nan
        time_slope = float(np.polyfit(group["T"], group["time"], 1)[0]) if enough else math.nan
        rows.append({"engine": engine, "T_values": len(group), "peak_bytes_per_step": peak_slope,
                     "peak_per_step_in_W": peak_slope / (hidden * hidden * np.dtype(dtype).itemsize),
                     "time_s_per_step": time_slope})
    return pd.DataFrame(rows, columns=["engine", "T_values", "peak_bytes_per_step", "peak_per_step_in_W",
                                       "time_s_per_step"])


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def run(*, device="auto", dtype: str = "float32", batch: int = SEED_SIZES["batch"],
        hidden: int = SEED_SIZES["hidden"], T_values=(SEED_SIZES["T"],), engines=ENGINE_NAMES,
        repeats: int = 1, trials: int = 1, warmup: int = 0, seed: int = 0, malloc: str | None = None,
        timeout_s: float = 600, progress=print) -> EngineComparison:
    """Every engine at every T in its own process; cases are labelled "T=<steps>"."""
    _positive_int("batch", batch)
    _positive_int("hidden", hidden)
    if isinstance(T_values, (str, int)) or not list(T_values):
        raise ValueError(f"T_values must be a non-empty list of positive integers, got {T_values!r}")
    T_values = [_positive_int("each T", T) for T in T_values]
    if len(set(T_values)) != len(T_values):
        raise ValueError(f"T_values lists a value twice: {T_values}")
    return compare_engines(
        benchmark=BENCHMARK, target=TARGET,
        cases={f"T={T}": {"batch": batch, "hidden": hidden, "T": T, "seed": seed} for T in T_values},
        engines=engines, device=device, dtype=dtype, repeats=repeats, trials=trials, warmup=warmup,
        memory_required=lambda engine, params: memory_required_bytes(engine, batch, hidden, params["T"], dtype),
        malloc=malloc, timeout_s=timeout_s,
        describe={"model": "h_t = tanh(h_{t-1} W + b), logistic output per step, loss summed over steps"},
        progress=progress)
