"""A tanh RNN with shared weights over T steps: the fan-out benchmark of HIPS autograd #219.

Sizes and data are autograd's own `benchmarks/bench_rnn.py` (batch 16, hidden 1024, 50 steps,
float32, weights 0.01·N(0, 1)): h₀ = x, hₜ = tanh(hₜ₋₁·W + b). Two models (`MODELS`):

- `bench_rnn`, autograd's benchmark as it is: one logistic output after the last step,
  logit = h_T·Wout + bout. Its hand-written gradient is the engine `manual-seed` (written from
  the benchmark's description: three stacks of forward values, a 1/cosh² tanh gradient, each
  accumulator started from 0 so its first contribution is copied, VJP results kept until the
  next step overwrites them).
- `per-step-loss`, this project's variant: one logistic output per step, the loss summed over
  all T outputs, so Wout and bout fan out T times as well. No seed gradient exists for it, so
  `manual-seed` is recorded as not applicable.

The gradient is taken with respect to all weights (W, b, Wout, bout); W and b are used T times:
keeping every contribution until the end costs T weight-sized buffers, accumulating in place
costs one. `manual` (both models) is lean backpropagation through time that stores the hidden
states and pops them: the floor.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from benchlib.engines import ENGINE_NAMES, get_engine
from benchlib.benchmark import Benchmark, Config, Parameter, Seed, distinct
from benchlib.trials.cases import (DATA_DTYPE, Cases, EngineComparison, comparison_parameters, comparison_rules,
                                   compare_engines)
from benchlib.engines.gradients import save_gradient
from benchlib.engines.namespaces import segmentation_params
from benchlib.engine_names import AUTOGRAD, BENCHLIB_DEFERRED, BENCHLIB_INPLACE, MANUAL, MANUAL_SEED, TORCH
from benchlib.engines.roles import role_gauge, tape_roles
from benchlib.measure import MALLOC_POLICIES, Case, mark
from benchlib.analysis.seed_verdicts import RatioRule, SlopeRule

SEED_SIZES = {"batch": 16, "hidden": 1024, "T": 50}
# Not run unless named: under autocast to bfloat16 the seed's RNN (weights of scale 0.01) loses whole gradients
# (Wout's is 0 at small sizes), so it fails the gradient check at every T (tests/test_chain_techniques.py); and
# torch.compile, whose compile in every fresh process added 67 s to this notebook's default run (docs/techniques.md)
DEFAULT_ENGINES = tuple(engine for engine in ENGINE_NAMES
                        if not (get_engine(engine).compiles or get_engine(engine).lowers_to))
DATA_SEED = 0  # the seed of the weights and inputs: every engine differentiates the same data
TARGET = "benchlib.workloads.rnn:case"
WEIGHTS = ("W", "b", "Wout", "bout")
WEIGHT_ARGNUMS = (0, 1, 2, 3)
MODELS = {
    "bench_rnn": "autograd's bench_rnn: h_t = tanh(h_{t-1} W + b), one logistic output after the last step",
    "per-step-loss": "h_t = tanh(h_{t-1} W + b), a logistic output per step, the loss summed over steps",
}
SEED_GRADIENT_MODELS = ("bench_rnn",)  # the models manual-seed exists for


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


def _logistic(xp, logit, label):
    """bench_rnn's loss of one output: -sum(label·logit - (logit + log(1 + exp(-logit))))."""
    return xp.sum(logit * (1 - label) + xp.log(1 + xp.exp(-logit)))


def bench_rnn_loss(xp, T: int):
    """autograd's bench_rnn: the logistic loss of one output after the last step."""

    def loss(W, b, Wout, bout, x, label):
        mark("forward")
        h = xp.chain(lambda h: xp.tanh(xp.dot(h, W) + b), x, T)
        total = _logistic(xp, xp.dot(h, Wout) + bout, label)
        mark("backward")
        return total

    return loss


def rnn_loss(xp, T: int):
    """Summed logistic loss of the T outputs, written once against `xp`; marks where backward begins."""

    def loss(W, b, Wout, bout, x, label):
        def step(state):
            h, total = state
            h = xp.tanh(xp.dot(h, W) + b)
            loss_t = _logistic(xp, xp.dot(h, Wout) + bout, label)
            return h, loss_t if total is None else total + loss_t

        mark("forward")
        _, total = xp.chain(step, step((x, None)), T - 1)
        mark("backward")
        return total

    return loss


def chain_steps(model: str, T: int) -> int:
    """The steps of the `xp.chain` in `model`'s loss (per-step-loss takes its first step outside it)."""
    return T if model == "bench_rnn" else T - 1


def _forward_states(xp, W, b, x, T: int, step_output=None) -> list:
    """The hidden states [x, h_1, ..., h_T], each step computed in its own new buffer (h·W, then + b and
    tanh in place: no temporaries); `step_output(h)` is called with each new state."""
    hidden_states = [x]
    h = x
    for _ in range(T):
        h = xp.dot(h, W)
        h += b
        xp.tanh(h, out=h)
        hidden_states.append(h)
        if step_output is not None:
            step_output(h)
    return hidden_states


def _tanh_gradient_in_place(h, dh):
    """da = dh·(1 - h²), written over h: a state's last use is its own tanh gradient, so da takes its buffer."""
    h *= h
    h -= 1
    h *= -1
    h *= dh
    return h


def _add_product(xp, total, scratch, a, b):
    """(total + a·b, scratch): the first product becomes the total, every later one is written into one
    scratch buffer reused for all of them (NumPy has no multiply-accumulate) and added in place."""
    if total is None:
        return xp.dot(a, b), scratch
    if scratch is None:
        scratch = xp.dot(a, b)
    else:
        xp.dot(a, b, out=scratch)
    total += scratch
    return total, scratch


def _accumulate(total, contribution):
    if total is None:
        return contribution
    total += contribution
    return total


def manual_gradient(xp, T: int):
    """Lean backpropagation through time for per-step-loss (engine `manual`, the floor): the hidden
    states stored and popped, each one's buffer reused for its tanh gradient, dh and the W-sized
    scratch reused at every step, gradients accumulated in place."""

    def gradient(W, b, Wout, bout, x, label):
        mark("forward")
        logits = []
        hidden_states = _forward_states(xp, W, b, x, T, lambda h: logits.append(xp.dot(h, Wout) + bout))
        mark("backward")
        dW = db = dWout = dbout = dh = scratch = None
        for _ in range(T):
            h = hidden_states.pop()
            dlogit = 1 / (1 + xp.exp(-logits.pop())) - label
            dWout = _accumulate(dWout, xp.dot(h.T, dlogit))
            dbout = _accumulate(dbout, xp.sum(dlogit, axis=0))
            dh = _accumulate(dh, xp.dot(dlogit, Wout.T))
            da = _tanh_gradient_in_place(h, dh)
            dW, scratch = _add_product(xp, dW, scratch, hidden_states[-1].T, da)
            db = _accumulate(db, xp.sum(da, axis=0))
            xp.dot(da, W.T, out=dh)
        return dW, db, dWout, dbout

    return gradient


def bench_rnn_manual_gradient(xp, T: int):
    """Lean backpropagation through time for bench_rnn (engine `manual`, the floor): the hidden states
    stored and popped, each one's buffer reused for its tanh gradient, dh and the W-sized scratch
    reused at every step, gradients accumulated in place; at its peak it holds the states, dW and
    the scratch."""

    def gradient(W, b, Wout, bout, x, label):
        mark("forward")
        hidden_states = _forward_states(xp, W, b, x, T)
        h = hidden_states[-1]
        logit = xp.dot(h, Wout) + bout
        mark("backward")
        dlogit = 1 / (1 + xp.exp(-logit)) - label
        dWout, dbout = xp.dot(h.T, dlogit), xp.sum(dlogit, axis=0)
        dh = xp.dot(dlogit, Wout.T)
        del h
        dW = db = scratch = None
        for _ in range(T):
            da = _tanh_gradient_in_place(hidden_states.pop(), dh)
            dW, scratch = _add_product(xp, dW, scratch, hidden_states[-1].T, da)
            db = _accumulate(db, xp.sum(da, axis=0))
            xp.dot(da, W.T, out=dh)
        return dW, db, dWout, dbout

    return gradient


def bench_rnn_seed_gradient(xp, T: int):
    """bench_rnn's own hand-written gradient (engine `manual-seed`), written from the benchmark's
    description with its buffer lifetimes: the forward pass keeps three stacks (the products
    h·W, the pre-activations, the inputs of each step), the loss is unrolled into its temporaries,
    tanh's gradient is g / cosh(a)², every accumulator starts at 0 (so its first contribution is
    copied), and each step's VJP results stay alive until the next step overwrites them."""

    def sum_to_match(value, like):
        value = xp.sum(value, axis=tuple(range(value.ndim - like.ndim))) if value.ndim > like.ndim else value
        for axis, size in enumerate(like.shape):
            if size == 1:
                value = xp.sum(value, axis=axis, keepdims=True)
        return value

    def gradient(W, b, Wout, bout, x, label):
        mark("forward")
        products_stack, product = [], None
        pre_stack, pre = [], None
        inputs_stack = []
        h = x
        for _ in range(T):
            products_stack.append(product)
            product = xp.dot(h, W)
            pre_stack.append(pre)
            pre = product + b
            inputs_stack.append(h)
            h = xp.tanh(pre)
        out_0 = xp.dot(h, Wout)
        out = out_0 + bout
        loss_2 = label * out
        loss_7 = -out
        loss_6 = xp.exp(loss_7)
        loss_5 = 1 + loss_6
        loss_4 = xp.log(loss_5)
        loss_3 = out + loss_4
        loss_1 = loss_2 - loss_3
        mark("backward")
        g_pre = g_product = g_b = g_W = 0
        g_loss_1 = xp.ones_like(loss_1) * -1  # reverse of loss = -sum(loss_1)
        g_loss_2 = sum_to_match(g_loss_1, loss_2)
        g_loss_3 = sum_to_match(-g_loss_1, loss_3)
        g_out = sum_to_match(g_loss_3, out)
        g_loss_4 = sum_to_match(g_loss_3, loss_4)
        g_loss_5 = g_loss_4 / loss_5
        g_loss_6 = sum_to_match(g_loss_5, loss_6)
        g_loss_7 = g_loss_6 * xp.exp(loss_7)
        g_out += -g_loss_7
        g_out += sum_to_match(g_loss_2 * label, out)
        g_out_0 = sum_to_match(g_out, out_0)
        g_bout = sum_to_match(g_out, bout)
        g_h = xp.dot(g_out_0, Wout.T)
        g_Wout = xp.dot(h.T, g_out_0)
        for _ in range(T):
            h = inputs_stack.pop()
            tmp_g0 = g_h / xp.cosh(pre) ** 2.0
            g_h = 0
            g_pre += tmp_g0
            pre = pre_stack.pop()
            tmp_g1 = sum_to_match(g_pre, product)
            tmp_g2 = sum_to_match(g_pre, b)
            g_pre = 0
            g_product += tmp_g1
            g_b += tmp_g2
            product = products_stack.pop()
            tmp_g3 = xp.dot(g_product, W.T)
            tmp_g4 = xp.dot(h.T, g_product)
            g_product = 0
            g_h += tmp_g3
            g_W += tmp_g4
        return g_W, g_b, g_Wout, g_bout

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
    kept = T * weight if get_engine(engine).keeps_contributions else 0
    return int(6 * weight + states + kept)


def case(*, device, engine: str, batch: int, hidden: int, T: int, dtype: str, gradient_dir: str,
         model: str = "bench_rnn") -> Case:
    """One engine's gradient call, set up in the isolation child.

    The check saves the last call's gradients of (W, b, Wout, bout) to `gradient_dir`; the parent
    compares them with manual's.
    """
    chosen = get_engine(engine)
    arrays = {name: chosen.asarray(value, device) for name, value in make_data(batch, hidden, dtype, DATA_SEED).items()}
    args = tuple(arrays[name] for name in (*WEIGHTS, "x", "label"))
    del arrays
    xp = chosen.namespace(device)
    if model == "bench_rnn":
        loss, hand_written = bench_rnn_loss(xp, T), {MANUAL: bench_rnn_manual_gradient(xp, T),
                                                     MANUAL_SEED: bench_rnn_seed_gradient(xp, T)}
    else:
        loss, hand_written = rnn_loss(xp, T), {MANUAL: manual_gradient(xp, T)}
    gradient = chosen.gradient(loss, WEIGHT_ARGNUMS, manual=hand_written)

    set_up = chosen.prepare(lambda: gradient(*args), device)  # torch.compile compiles here, untimed by the trial

    def check(result) -> dict[str, float]:
        save_gradient(result, gradient_dir, engine)
        return {**set_up, **tape_roles(gradient)}  # torch's saved bytes: from the role timeline's call

    return Case(lambda: gradient(*args), check, roles=role_gauge(chosen, gradient, inputs=args))


def growth_per_step(records: pd.DataFrame) -> pd.DataFrame:
    """Per engine, the least-squares slope of peak memory and of median time against T, from the
    records of a sweep: the fan-out cost per step, measured. `peak_per_step_in_W` is the peak's
    slope in units of one W-sized buffer (hidden²·itemsize of the data, from the records' params and dtype).
    Engines measured at fewer than two T values get NaN."""
    measured = records[records["metric"].isin(["peak_bytes", "time"])]
    params = measured["params"].map(json.loads)
    # W's bytes in the data's dtype: a lowering engine (autocast) labels its records with the dtype it computes in
    data_dtype = [p.get(DATA_DTYPE, dtype) for p, dtype in zip(params, measured["dtype"])]
    table = (measured.assign(T=params.map(lambda p: p["T"]), hidden=params.map(lambda p: p["hidden"]), dtype=data_dtype)
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


def run(config: Config, device="auto", *, timeout_s: float = 600, progress=print, results=None) -> EngineComparison:
    """Every engine at every T (`T` and `T_sweep`) in its own process; cases are labelled "T=<steps>".
    `config` is this benchmark's (`BENCHMARK.config(...)`)."""
    batch, hidden, model, dtype = config.batch, config.hidden, config.model, config.dtype
    cases = Cases(
        BENCHMARK.name, TARGET,
        {f"T={T}": {"batch": batch, "hidden": hidden, "T": T, "model": model} for T in sorted({*config.T_sweep, config.T})},
        memory_required=lambda engine, params: memory_required_bytes(engine, batch, hidden, params["T"], dtype),
        describe={"model_description": MODELS[model], "seed": DATA_SEED},
        engine_params=lambda engine, params: segmentation_params(engine, chain_steps(model, params["T"])),
        not_applicable=lambda engine: (None if not get_engine(engine).seed_written or model in SEED_GRADIENT_MODELS else
                                       f"model {model!r} has no seed-written gradient (only "
                                       f"{', '.join(SEED_GRADIENT_MODELS)} does)"))
    return compare_engines(cases, config, device=device, timeout_s=timeout_s, progress=progress, results=results)


def _weight_bytes(params: dict) -> float:
    """One W-sized buffer of a record's params: the unit the per-step slopes are judged in."""
    return float(params["hidden"]) ** 2 * np.dtype(params["dtype"]).itemsize


def _rules(config) -> None:
    comparison_rules(config)
    distinct("T_sweep", config.T_sweep)


def _memory(config, device) -> int:
    steps = max(config.T, *config.T_sweep)
    return max(memory_required_bytes(engine, config.batch, config.hidden, steps, config.dtype) for engine in config.engines)


BENCHMARK = Benchmark(
    name="rnn_fanout",
    question="How does peak memory grow with sequence length (fan-out of shared weights)?",
    seed=Seed("HIPS/autograd #219 and autograd's benchmarks/bench_rnn.py", "https://github.com/HIPS/autograd/issues/219"),
    notebook="rnn_fanout.ipynb",
    cases="one gradient per engine at every T of T and T_sweep, each in fresh processes: peak, time, memory by "
          "role and the gradient's error against manual, and the peak's growth per step",
    parameters=(
        Parameter("model", "bench_rnn", "the RNN: " + "; ".join(f"{name}: {what}" for name, what in MODELS.items()),
                  choices=tuple(MODELS)),
        Parameter("batch", SEED_SIZES["batch"], "sequences per batch", quick=2, minimum=1),
        Parameter("hidden", SEED_SIZES["hidden"], "hidden units (W is hidden x hidden)", quick=32, minimum=1),
        Parameter("T", SEED_SIZES["T"], "steps of the headline case", quick=4, minimum=1),
        Parameter("T_sweep", (25, 50, 100, 200), "step counts of the growth sweep (T is added)", quick=(2, 4), minimum=1),
        # mmap-64k: the hidden states (64 KiB at the seed's sizes) are mappings of their own, so every
        # engine's peak is its live memory, not the heap its freed temporaries stranded
        *comparison_parameters(dtype="float32", engines=DEFAULT_ENGINES, repeats=3, trials=5, warmup=1,
                               quick={"repeats": 1}, malloc="mmap-64k"),
    ),
    rules=_rules,
    memory=_memory,
    headline=("peak_bytes", "time"),
    verdicts=(
        RatioRule("rnn_fanout", "autograd #219 (RNN): with in-place accumulation autograd's peak is the same order of "
                  "magnitude as torch's", "peak_bytes", AUTOGRAD, TORCH, 0.1, 10.0, per=("T",)),
        SlopeRule("rnn_fanout", "autograd #219 (RNN): keeping every contribution grows the peak by about one weight "
                  "per step", "peak_bytes", BENCHLIB_DEFERRED, "T", "W-sized buffers", _weight_bytes, 0.7, 1.5),
        SlopeRule("rnn_fanout", "autograd #219 (RNN): in-place accumulation keeps the peak nearly flat in the step "
                  "count", "peak_bytes", BENCHLIB_INPLACE, "T", "W-sized buffers", _weight_bytes, -0.25, 0.25),
    ),
)
