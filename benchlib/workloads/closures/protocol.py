"""The seed's four-step protocol per MWE, engine and order: timing and allocation passes, records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from benchlib.engines.gradients import GRAD_ERROR_METRIC, GRADIENT_TOLERANCE, max_relative_error
from benchlib.measure import count_allocations, resolve_device, time_call
from benchlib.results import make_record, status_record
from benchlib.workloads.closures.spec import (
    NAME, MWES, MWE_DTYPES, ORDERS, INITIAL, RERUN, NEW, RESETUP, STEPS, PAIRS, ENGINES, VALID_ENGINES,
    COMPILE_BACKENDS, N_SAMPLES, BATCH_SIZE, GRADS_IDENTICAL, NOT_APPLICABLE, TRACKER_CASE, DEFAULTS,
)
from benchlib.workloads.closures.engines import not_applicable, make_engine
from benchlib.workloads.closures.mwes import (
    ClosureState, reference_gradients, MWE, gradients_numpy, identical,
)


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
    dtype = MWE_DTYPES[mwe_name]
    base_params = dict(mwe=mwe_name, order=order, warmup=warmup, repeats=repeats, cold_passes=cold_passes,
                       alloc_passes=alloc_passes, alloc_samples=alloc_samples, seed=seed,
                       n_samples=N_SAMPLES, batch_size=BATCH_SIZE)
    reason = not_applicable(engine_name, device)
    if reason is not None:
        return [status_record(status=NOT_APPLICABLE, message=reason, benchmark=NAME,
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
        records.append(make_record(benchmark=NAME, case=case_name(mwe, order, step_label), engine=engine,
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
                if a.python_count is not None:  # CPU: memray also traced Python's allocator
                    add(step, f"{phase}_alloc_count_python", a.python_count, "count", i, **labels)
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
                                    ("alloc_bytes", allocations.bytes, "B"),
                                    ("alloc_count_python", allocations.python_count, "count")):
            if value is None:
                continue
            records.append(make_record(benchmark=NAME, case=TRACKER_CASE, tracker=allocations.source,
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
                    progress(f"{NAME} {mwe} {engine} {order}: {len(new)} records")
    return records


