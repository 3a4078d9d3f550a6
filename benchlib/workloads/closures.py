"""identical_closures (Zygote.jl #1206): do structurally identical loss closures cost the same?

In Julia every closure has its own type and the gradient code is compiled per type; in the seed
the first-created of two identical closures kept 419 allocations per call where the second
needed 329. Python has no per-type compilation, but it has per-code-object state: each `setup`
function below owns the code object of the closure it builds, and torch.compile caches compiled
graphs per code object (CPython's specialising interpreter also warms up per code object).

Two minimal working examples (MWEs), written once against an engine's array namespace `xp`:
- `dense`: the seed's MWE. Dense(8 -> 1), mse loss, X 8x10, Y 1x10 in float32, batches of 2;
  `setup1` and `setup2` build the same loss closure over the model; `train(state)` takes one
  gradient per batch and collects them.
- `reduced`: the seed's reduction. x -> sum(exp(x)) splatted over a 1-tuple, one pullback.

The protocol (`run_protocol`) follows the seed: initial (state1), re-run, structurally identical
new (state2), re-setup initial (state1 built again); the `reversed` order starts from setup2.
Each step's first call is its cold measurement, followed by warm-up calls; the warm (steady-state)
calls of the four steps are then timed round-robin. Times and allocations come from separate
passes (tracing slows code), each starting from fresh set-ups and, for torch.compile, from
`torch._dynamo.reset()`. `run` gathers every MWE x engine x order; `seed_table` and
`verdict_table` turn the records into the notebook's tables (verdicts: `benchlib.results.stats`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pandas as pd

from benchlib.engines import Engine, get_engine
from benchlib.engines.comparison import GRAD_ERROR_METRIC, GRADIENT_TOLERANCE, max_relative_error
from benchlib.measure import count_allocations, resolve_device, time_call
from benchlib.results import make_record, status_record
from benchlib.results.stats import DEFAULT_ALPHA, DEFAULT_MIN_EFFECT, compare_counts, compare_times

BENCHMARK = "identical_closures"
MWES = ("dense", "reduced")
DTYPES = {"dense": "float32", "reduced": "float64"}
# Which setup builds state1 and which state2, per order.
ORDERS = {"seed": ("setup1", "setup2"), "reversed": ("setup2", "setup1")}
INITIAL, RERUN, NEW, RESETUP = "initial", "re-run", "structurally identical new", "re-setup initial"
STEPS = (INITIAL, RERUN, NEW, RESETUP)
PHASES = ("cold", "warm")
# The pairs a verdict is given for. A re-run's first call is not cold, so cold has no control pair.
PAIRS = {
    "warm": ((INITIAL, NEW), (RESETUP, NEW), (INITIAL, RERUN)),
    "cold": ((INITIAL, NEW), (RESETUP, NEW)),
}
SHARED_ENGINES = ("benchlib-inplace", "benchlib-deferred", "autograd", "torch")
COMPILE_ENGINE, FUNC_ENGINE = "torch.compile", "torch.func"
ENGINES = ("benchlib-inplace", "autograd", "torch", COMPILE_ENGINE, FUNC_ENGINE)
VALID_ENGINES = SHARED_ENGINES + (COMPILE_ENGINE, FUNC_ENGINE)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
N_SAMPLES, N_IN, N_OUT, BATCH_SIZE = 10, 8, 1, 2
GRADS_IDENTICAL = "grads_identical"
NOT_APPLICABLE = "not_applicable"
TRACKER_CASE = "no-op"  # the tracker's own rows: dimension "tracker", variant the tracker's name

DEFAULTS = dict(warmup=3, repeats=30, cold_passes=5, alloc_passes=2, alloc_samples=2,
                backend="inductor", seed=0)


# --- engines ----------------------------------------------------------------------------------

class CompileCounter:
    """A torch.compile backend that counts the graphs Dynamo hands it, then compiles them with `backend`."""

    def __init__(self, backend: str):
        import torch._dynamo

        self.backend = backend
        self._compile = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self._compile(graph_module, example_inputs)

    def wrap(self, fn: Callable) -> Callable:
        import torch

        return torch.compile(fn, backend=self)

    @staticmethod
    def cache_entries(code: CodeType) -> int:
        """Compiled entries Dynamo holds for one code object (more than one means it recompiled)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))

    @staticmethod
    def forget_compiled() -> None:
        """Forget every compiled graph, as in a fresh process (on-disk caches stay).

        (Not named `reset`: Dynamo calls a backend's `reset` from torch._dynamo.reset.)"""
        import torch._dynamo

        torch._dynamo.reset()

    def describe(self) -> dict:
        import torch._inductor.config as inductor_config

        return {"backend": self.backend, "fx_graph_cache": bool(inductor_config.fx_graph_cache)}


def _torch_func_gradient(fun: Callable, argnum) -> Callable:
    import torch.func

    return torch.func.grad(fun, argnums=argnum)


def _identity(fn: Callable) -> Callable:
    return fn


@dataclass
class ClosureEngine:
    """An engine as this benchmark needs it: gradients, arrays, and what a setup does to its closure.

    torch.compile and torch.func.grad reuse the shared `torch` engine's arrays and namespace; the
    first compiles each loss closure in its setup function (so per code object), the second
    differentiates with torch.func.grad instead of torch.autograd.
    """

    name: str
    base: Engine
    device: Any
    gradient: Callable[[Callable, Any], Callable]
    wrap_loss: Callable[[Callable], Callable] = _identity
    compiler: CompileCounter | None = None
    xp: Any = field(init=False)

    def __post_init__(self):
        self.xp = self.base.namespace(self.device)

    def asarray(self, array: np.ndarray):
        return self.base.asarray(array, self.device)

    def reset(self) -> None:
        """Start a pass as a fresh process would, as far as the engine goes: torch.compile forgets its graphs."""
        if self.compiler is not None:
            self.compiler.forget_compiled()

    def describe(self) -> dict:
        return {} if self.compiler is None else self.compiler.describe()


def not_applicable(engine: str, device) -> str | None:
    """Why `engine` cannot run on `device`, or None."""
    base = get_engine("torch" if engine in (COMPILE_ENGINE, FUNC_ENGINE) else engine)
    return base.not_applicable(resolve_device(device))


def make_engine(name: str, device, backend: str = DEFAULTS["backend"]) -> ClosureEngine:
    """The engine called `name` (one of VALID_ENGINES) on `device`."""
    if name not in VALID_ENGINES:
        raise ValueError(f"unknown engine {name!r}; valid: {', '.join(VALID_ENGINES)}")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    device = resolve_device(device)
    if name == COMPILE_ENGINE:
        compiler = CompileCounter(backend)
        torch_engine = get_engine("torch")
        return ClosureEngine(name, torch_engine, device, torch_engine.gradient, compiler.wrap, compiler)
    if name == FUNC_ENGINE:
        return ClosureEngine(name, get_engine("torch"), device, _torch_func_gradient)
    engine = get_engine(name)
    return ClosureEngine(name, engine, device, engine.gradient)


# --- the MWEs -------------------------------------------------------------------------------------

@dataclass
class ClosureState:
    """What a setup returns (the seed's named tuple), plus the closure's code object."""

    setup: str
    engine: ClosureEngine
    loss: Callable
    code: CodeType
    inputs: tuple
    batches: tuple = ()


@dataclass(frozen=True)
class Dense:
    """Flux's Dense(n_in => n_out): W x .+ b. Parameters are passed in so every engine can differentiate them."""

    xp: Any
    W: Any
    b: Any

    def __call__(self, W, b, x):
        return self.xp.matmul(W, x) + b

    @property
    def params(self) -> tuple:
        return (self.W, self.b)


def mse(xp, prediction, target):
    """Flux.mse: the mean of squared differences."""
    difference = prediction - target
    return xp.mean(difference * difference)


def dense_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """X, Y (uniform in [0, 1), as the seed's rand) and Flux's initial W (Glorot uniform) and b (zeros)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES["dense"]
    limit = math.sqrt(6.0 / (N_IN + N_OUT))
    return {
        "X": rng.random((N_IN, N_SAMPLES)).astype(dtype),
        "Y": rng.random((N_OUT, N_SAMPLES)).astype(dtype),
        "W": rng.uniform(-limit, limit, (N_OUT, N_IN)).astype(dtype),
        "b": np.zeros((N_OUT, 1), dtype=dtype),
    }


def reduced_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The seed's X = (1,): one scalar (an Int there, promoted to Float64 by exp), held 0-d."""
    return {"x": np.array(1.0, dtype=DTYPES["reduced"])}


def _batches(X: np.ndarray, Y: np.ndarray, engine: ClosureEngine) -> tuple:
    """The seed's DataLoader((X, Y), batchsize=2): column blocks, as the engine's arrays."""
    return tuple((engine.asarray(np.ascontiguousarray(X[:, i:i + BATCH_SIZE])),
                  engine.asarray(np.ascontiguousarray(Y[:, i:i + BATCH_SIZE])))
                 for i in range(0, X.shape[1], BATCH_SIZE))


def _dense_state(setup: str, loss: Callable, X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    return ClosureState(setup, engine, engine.wrap_loss(loss), loss.__code__, model.params,
                        _batches(X, Y, engine))


def setup1(X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    """The seed's setup1: a loss closure over `model`, and the data in batches."""
    xp = engine.xp

    def loss(W, b, x, y):
        return mse(xp, model(W, b, x), y)

    return _dense_state("setup1", loss, X, Y, model, engine)


def setup2(X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    """setup1 again, written out a second time: the same closure from another code object."""
    xp = engine.xp

    def loss(W, b, x, y):
        return mse(xp, model(W, b, x), y)

    return _dense_state("setup2", loss, X, Y, model, engine)


def train(state: ClosureState) -> list:
    """The seed's train: one gradient of the loss per batch with respect to the model's parameters, collected."""
    grads = []
    W, b = state.inputs
    for x, y in state.batches:
        grads.append(state.engine.gradient(lambda W, b: state.loss(W, b, x, y), (0, 1))(W, b))
    return grads


def splat(f: Callable) -> Callable:
    """Julia's Base.splat: f applied to the elements of one tuple argument."""
    return lambda args: f(*args)


def _reduced_state(setup: str, f: Callable, x, engine: ClosureEngine) -> ClosureState:
    return ClosureState(setup, engine, splat(engine.wrap_loss(f)), f.__code__, (x,))


def reduced_setup1(x, engine: ClosureEngine) -> ClosureState:
    """The reduced setup1: x -> sum(exp(x)), to be splatted over a 1-tuple."""
    xp = engine.xp

    def f(x):
        return xp.sum(xp.exp(x))

    return _reduced_state("setup1", f, x, engine)


def reduced_setup2(x, engine: ClosureEngine) -> ClosureState:
    """reduced_setup1 written out a second time."""
    xp = engine.xp

    def f(x):
        return xp.sum(xp.exp(x))

    return _reduced_state("setup2", f, x, engine)


def reduced_train(state: ClosureState):
    """The reduced train: the gradient of the splatted closure at the 1-tuple (the seed's pullback and back(1))."""
    return state.engine.gradient(lambda x: state.loss((x,)), 0)(*state.inputs)


def reference_gradients(mwe: str, seed: int = 0) -> list:
    """Hand-written float64 gradients of one train() call, per batch: what every engine is checked against."""
    if mwe == "reduced":
        return [np.exp(reduced_arrays(seed)["x"].astype(np.float64))]
    arrays = {k: v.astype(np.float64) for k, v in dense_arrays(seed).items()}
    W, b, X, Y = arrays["W"], arrays["b"], arrays["X"], arrays["Y"]
    grads = []
    for i in range(0, N_SAMPLES, BATCH_SIZE):
        x, y = X[:, i:i + BATCH_SIZE], Y[:, i:i + BATCH_SIZE]
        d_prediction = 2.0 * (W @ x + b - y) / y.size
        grads.append((d_prediction @ x.T, d_prediction.sum(axis=1, keepdims=True)))
    return grads


class MWE:
    """One MWE for one engine: its arrays, its two setups and its train."""

    def __init__(self, mwe: str, engine: ClosureEngine, seed: int = 0):
        self.mwe, self.engine = mwe, engine
        if mwe == "dense":
            arrays = dense_arrays(seed)
            self._X, self._Y = arrays["X"], arrays["Y"]
            self._model = Dense(engine.xp, engine.asarray(arrays["W"]), engine.asarray(arrays["b"]))
            self.train = train
        else:
            self._x = engine.asarray(reduced_arrays(seed)["x"])
            self.train = reduced_train

    def setup(self, name: str) -> ClosureState:
        if self.mwe == "dense":
            return {"setup1": setup1, "setup2": setup2}[name](self._X, self._Y, self._model, self.engine)
        return {"setup1": reduced_setup1, "setup2": reduced_setup2}[name](self._x, self.engine)


def gradients_numpy(grads) -> list[np.ndarray]:
    """Every array of a train() result, flattened to a list of NumPy arrays."""
    if isinstance(grads, (list, tuple)):
        return [array for item in grads for array in gradients_numpy(item)]
    return [Engine.to_numpy(grads)]


def identical(grads_a, grads_b) -> bool:
    """Bit-for-bit equality, as the seed's `train(state1) == train(state2)`."""
    a, b = gradients_numpy(grads_a), gradients_numpy(grads_b)
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


# --- the protocol ---------------------------------------------------------------------------------

def protocol_states(mwe: MWE, order: str) -> Iterator[tuple[str, ClosureState]]:
    """(step, state) in the seed's order, each state set up just before its step, as the seed does."""
    first, second = ORDERS[order]
    state1 = mwe.setup(first)
    yield INITIAL, state1
    yield RERUN, state1
    yield NEW, mwe.setup(second)
    yield RESETUP, mwe.setup(first)


def case_name(mwe: str, order: str, step: str) -> str:
    return f"{mwe}/{order}/{step}"


def validate(*, mwes: Iterable[str], engines: Iterable[str], orders: Iterable[str], warmup: int,
             repeats: int, cold_passes: int, alloc_passes: int, alloc_samples: int, backend: str,
             seed: int) -> None:
    """Refuse bad arguments before anything runs, naming what is valid."""
    for label, given, valid in (("mwes", mwes, MWES), ("engines", engines, VALID_ENGINES),
                                ("orders", orders, tuple(ORDERS))):
        if isinstance(given, str) or not list(given):
            raise ValueError(f"{label} must be a non-empty list drawn from {', '.join(valid)}, got {given!r}")
        unknown = [name for name in given if name not in valid]
        if unknown:
            raise ValueError(f"unknown {label} {unknown}; valid: {', '.join(valid)}")
    for label, value, least in (("warmup", warmup, 0), ("repeats", repeats, 1), ("cold_passes", cold_passes, 1),
                                ("alloc_passes", alloc_passes, 1), ("alloc_samples", alloc_samples, 1),
                                ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{label} must be an integer >= {least}, got {value!r}")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")


@dataclass
class _Compiles:
    """torch.compile's graphs for one step in one pass: in the first call, in later calls, and
    how many of them were for a code object that already held a compiled entry (recompiles)."""

    cold: int = 0
    warm: int = 0
    recompiles: int = 0
    cache_entries: int = 0


@dataclass
class _Step:
    cold_times: list = field(default_factory=list)
    warm_times: list = field(default_factory=list)
    compiles: list = field(default_factory=list)  # one _Compiles per timing pass
    cold_allocs: list = field(default_factory=list)
    warm_allocs: list = field(default_factory=list)
    grads: Any = None


def _timed_call(mwe: MWE, state: ClosureState, compiles: _Compiles, *, cold: bool) -> float:
    """One train(state) call, timed by `time_call` (CUDA synchronised); compiled graphs tallied."""
    compiler = mwe.engine.compiler
    if compiler is not None:
        graphs, entries = compiler.graphs, compiler.cache_entries(state.code)
    seconds = time_call(lambda: mwe.train(state), mwe.engine.device)
    if compiler is not None:
        new_graphs = compiler.graphs - graphs
        if cold:
            compiles.cold += new_graphs
        else:
            compiles.warm += new_graphs
        compiles.recompiles += new_graphs - (1 if entries == 0 and new_graphs > 0 else 0)
        compiles.cache_entries = compiler.cache_entries(state.code)
    return seconds


def _timing_pass(mwe: MWE, order: str, steps: dict, *, warmup: int, repeats: int, keep_grads: bool) -> None:
    """Each step's first call (cold) and warm-up in the seed's order, then the warm calls of all
    steps round-robin: steady state is what they measure, and interleaving them lets a drifting
    machine load hit every step alike instead of whichever ran during it."""
    mwe.engine.reset()
    states, compiles = {}, {}
    for step, state in protocol_states(mwe, order):
        states[step], compiles[step] = state, _Compiles()
        steps[step].cold_times.append(_timed_call(mwe, state, compiles[step], cold=True))
        for _ in range(warmup):
            _timed_call(mwe, state, compiles[step], cold=False)
    for _ in range(repeats):
        for step, state in states.items():
            steps[step].warm_times.append(_timed_call(mwe, state, compiles[step], cold=False))
    for step, state in states.items():
        if mwe.engine.compiler is not None:
            steps[step].compiles.append(compiles[step])
        if keep_grads:
            steps[step].grads = gradients_numpy(mwe.train(state))


def _allocation_pass(mwe: MWE, order: str, steps: dict, *, warmup: int, alloc_samples: int) -> str:
    """Each step's first call and, after warm-up, `alloc_samples` identical calls, each under the
    tracker in a session of its own; returns the tracker's name."""
    engine, device = mwe.engine, mwe.engine.device
    engine.reset()
    source = ""
    for step, state in protocol_states(mwe, order):
        call = lambda: mwe.train(state)  # noqa: E731
        cold = count_allocations(call, device)
        steps[step].cold_allocs.append(cold)
        for _ in range(warmup):
            call()
        steps[step].warm_allocs.extend(count_allocations(call, device) for _ in range(alloc_samples))
        source = cold.source
    return source


def run_protocol(mwe_name: str, engine_name: str, order: str, *, device="auto", warmup: int = DEFAULTS["warmup"],
                 repeats: int = DEFAULTS["repeats"], cold_passes: int = DEFAULTS["cold_passes"],
                 alloc_passes: int = DEFAULTS["alloc_passes"], alloc_samples: int = DEFAULTS["alloc_samples"],
                 backend: str = DEFAULTS["backend"], seed: int = DEFAULTS["seed"]) -> list[dict]:
    """The seed's four steps for one MWE, engine and order: tidy records of times, allocations,
    compile counts and gradient checks."""
    validate(mwes=[mwe_name], engines=[engine_name], orders=[order], warmup=warmup, repeats=repeats,
             cold_passes=cold_passes, alloc_passes=alloc_passes, alloc_samples=alloc_samples,
             backend=backend, seed=seed)
    device = resolve_device(device)
    dtype = DTYPES[mwe_name]
    base_params = dict(mwe=mwe_name, order=order, warmup=warmup, repeats=repeats, cold_passes=cold_passes,
                       alloc_passes=alloc_passes, alloc_samples=alloc_samples, seed=seed,
                       n_samples=N_SAMPLES, batch_size=BATCH_SIZE)
    reason = not_applicable(engine_name, device)
    if reason is not None:
        return [status_record(status=NOT_APPLICABLE, message=reason, benchmark=BENCHMARK,
                              case=case_name(mwe_name, order, step), engine=engine_name, device=device, dtype=dtype,
                              params={**base_params, "step": step}) for step in STEPS]
    engine = make_engine(engine_name, device, backend)
    mwe = MWE(mwe_name, engine, seed)
    steps = {step: _Step() for step in STEPS}
    for index in range(cold_passes):
        _timing_pass(mwe, order, steps, warmup=warmup, repeats=repeats, keep_grads=index == 0)
    source = ""
    for _ in range(alloc_passes):
        source = _allocation_pass(mwe, order, steps, warmup=warmup, alloc_samples=alloc_samples)
    engine.reset()
    base_params |= engine.describe() | ({"alloc_source": source} if source else {})
    return _records(mwe_name, engine_name, order, device, dtype, steps, base_params, seed)


def _records(mwe: str, engine: str, order: str, device, dtype: str, steps: dict, base_params: dict,
             seed: int) -> list[dict]:
    records = []
    first, second = ORDERS[order]
    setups = {INITIAL: first, RERUN: first, NEW: second, RESETUP: first}

    def add(step_label: str, metric: str, value, unit: str, repeat: int = 0, **extra):
        records.append(make_record(benchmark=BENCHMARK, case=case_name(mwe, order, step_label), engine=engine,
                                   device=device, dtype=dtype, metric=metric, value=value, unit=unit,
                                   repeat=repeat, params={**base_params, **extra}))

    reference = reference_gradients(mwe, seed)
    tolerance = GRADIENT_TOLERANCE[dtype]
    for step, data in steps.items():
        labels = {"step": step, "setup": setups[step]}
        for i, t in enumerate(data.cold_times):
            add(step, "cold_time", t, "s", i, **labels)
        for i, t in enumerate(data.warm_times):
            add(step, "warm_time", t, "s", i, **labels)
        for phase, allocations in (("cold", data.cold_allocs), ("warm", data.warm_allocs)):
            for i, a in enumerate(allocations):
                add(step, f"{phase}_alloc_count", a.count, "count", i, **labels)
                add(step, f"{phase}_alloc_bytes", a.bytes, "B", i, **labels)
        for i, compiles in enumerate(data.compiles):
            add(step, "cold_compiles", compiles.cold, "count", i, **labels)
            add(step, "warm_compiles", compiles.warm, "count", i, **labels)
            add(step, "recompiles", compiles.recompiles, "count", i, **labels)
            add(step, "cache_entries", compiles.cache_entries, "count", i, **labels)
        add(step, GRAD_ERROR_METRIC, max_relative_error(data.grads, gradients_numpy(reference)), "",
            tolerance=tolerance, **labels)
    for a, b in PAIRS["warm"]:
        add(f"{a} vs {b}", GRADS_IDENTICAL, float(identical(steps[a].grads, steps[b].grads)), "",
            step=f"{a} vs {b}")
    return records


def tracker_records(device="auto", samples: int = 5) -> list[dict]:
    """The allocation tracker's own count for an empty call, `samples` times: its floor and jitter."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    device = resolve_device(device)
    records = []
    for i in range(samples):
        allocations = count_allocations(lambda: None, device)
        for metric, value, unit in (("alloc_count", allocations.count, "count"),
                                    ("alloc_bytes", allocations.bytes, "B")):
            records.append(make_record(benchmark=BENCHMARK, case=TRACKER_CASE, tracker=allocations.source,
                                       device=device, dtype="none", metric=metric, value=value, unit=unit,
                                       repeat=i, params={"alloc_source": allocations.source}))
    return records


def run(*, device="auto", mwes: Iterable[str] = MWES, engines: Iterable[str] = ENGINES,
        orders: Iterable[str] = tuple(ORDERS), progress: Callable[[str], None] | None = print,
        **sizes) -> list[dict]:
    """Every MWE x engine x order, plus the tracker's own jitter: the notebook's records."""
    options = DEFAULTS | sizes
    unknown = sorted(set(sizes) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; valid: {', '.join(DEFAULTS)}")
    # lists before validating: a generator would be used up by the check and run nothing
    mwes, engines, orders = (given if isinstance(given, str) else list(given) for given in (mwes, engines, orders))
    validate(mwes=mwes, engines=engines, orders=orders, **options)
    device = resolve_device(device)
    records = tracker_records(device, options["alloc_samples"])
    for mwe in mwes:
        for engine in engines:
            for order in orders:
                new = run_protocol(mwe, engine, order, device=device, **options)
                records += new
                if progress:
                    progress(f"{BENCHMARK} {mwe} {engine} {order}: {len(new)} records")
    return records


# --- tables -------------------------------------------------------------------------------------------

def expand_cases(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame's engine rows of this benchmark with mwe, order and step from their params."""
    rows = frame[(frame["benchmark"] == BENCHMARK) & (frame["dimension"] == "engine")]
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


def seed_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The seed's table: per MWE, order, engine and step, allocations, bytes and times, cold and warm.

    Allocations and bytes are floors over identical calls (see `benchlib.results.stats.compare_counts`), with
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
        warm_time, cold_time = _values(group, "warm_time"), _values(group, "cold_time")
        row = {
            "mwe": mwe, "order": order, "engine": engine, "step": step, "setup": setup,
            "warm allocs": _floor(_values(group, "warm_alloc_count")),
            "warm allocs range": _spread(_values(group, "warm_alloc_count")),
            "warm bytes": _floor(_values(group, "warm_alloc_bytes")),
            "warm time (µs)": 1e6 * _median(warm_time),
            "warm time q25 (µs)": 1e6 * _percentile(warm_time, 25),
            "warm time q75 (µs)": 1e6 * _percentile(warm_time, 75),
            "cold allocs": _floor(_values(group, "cold_alloc_count")),
            "cold allocs range": _spread(_values(group, "cold_alloc_count")),
            "cold bytes": _floor(_values(group, "cold_alloc_bytes")),
            "cold time (ms)": 1e3 * _median(cold_time),
            "cold time min (ms)": 1e3 * _percentile(cold_time, 0),
            "cold time max (ms)": 1e3 * _percentile(cold_time, 100),
            GRAD_ERROR_METRIC: _median(_values(group, GRAD_ERROR_METRIC)),
        }
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
    """A verdict per pair of steps (PAIRS), phase, engine, order and MWE: allocation counts and
    bytes against the tracker's jitter, times by Mann-Whitney U (p < alpha and a min_effect change),
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
                for quantity in ("count", "bytes"):
                    metric = f"{phase}_alloc_{quantity}"
                    sample_a, sample_b = _values(by_step[a], metric), _values(by_step[b], metric)
                    if not (sample_a.size and sample_b.size):
                        continue
                    jitter = None
                    if phase == "cold":  # few first calls: widen by what identical warm calls of both show
                        warm = [_values(by_step[s], f"warm_alloc_{quantity}") for s in (a, b)]
                        jitter = max([np.ptp(v) for v in warm if v.size] + [np.ptp(sample_a), np.ptp(sample_b)])
                    verdict = compare_counts(sample_a, sample_b, jitter=jitter)
                    label = "allocs" if quantity == "count" else "bytes"
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
    columns = [c for c in ("allocs verdict", "bytes verdict", "time verdict") if c in verdicts]
    if not columns:
        return verdicts.iloc[0:0]
    return verdicts[(verdicts[columns] == "differ").any(axis=1)]


def tracker_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The tracker's count and bytes for an empty call: median and range over samples."""
    rows = frame[(frame["benchmark"] == BENCHMARK) & (frame["dimension"] == "tracker")]
    return (rows.groupby(["device", "metric"])["value"].agg(["median", "min", "max", "count"]).reset_index())
