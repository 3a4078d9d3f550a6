"""The seed's four-step protocol per MWE, engine and order: timing and allocation passes, records."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from benchlib.errors import Refused
from benchlib.engines.gradients import GRAD_ERROR_METRIC, GRADIENT_TOLERANCE, max_relative_error
from benchlib.measure import attribute_allocations, count_allocations, resolve_device, time_call
from benchlib.records import make_record, status_record
from benchlib.trials.loop import NOT_STARTED_MESSAGE, stopping_rule
from benchlib.trials.stopping import Deadline
from benchlib.workloads.closures.spec import (
    NAME, MWE_DTYPES, ORDERS, INITIAL, RERUN, NEW, RESETUP, STEPS, PAIRS, N_SAMPLES, BATCH_SIZE, GRADS_IDENTICAL,
    NOT_APPLICABLE, TRACKER_CASE, Protocol,
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


def _attribution_pass(mwe: MWE, order: str, *, warmup: int) -> dict:
    """After the measured passes, from fresh set-ups: each step's warm call once more under memray, both
    allocators traced (a closure's Python objects are what the seed counted), grouped by site."""
    mwe.engine.reset()
    passes = {}
    for step, state in protocol_states(mwe, order):
        call = lambda: mwe.train(state)  # noqa: E731
        for _ in range(warmup + 1):
            call()
        passes[step] = attribute_allocations(call, python_allocators=True).to_dict()
    return passes


def attribution_records(passes: dict, mwe: str, engine: str, order: str, device, dtype: str,
                        base_params: dict) -> list[dict]:
    """The attribution pass's site records per step, and per warm verdict pair the site-by-site diff of
    the two steps' allocations (kind `diff`): by function and innermost frame, since the two closures are
    the same code at other lines."""
    from benchlib.analysis.sites import attribution_records as site_records, diff_records, diff_sites, pass_sites

    first, second = ORDERS[order]
    setups = {INITIAL: first, RERUN: first, NEW: second, RESETUP: first}
    labels = dict(benchmark=NAME, engine=engine, device=device, dtype=dtype)
    records = []
    for step, attribution in passes.items():
        records += site_records(attribution, case=case_name(mwe, order, step), **labels,
                                params={**base_params, "step": step, "setup": setups[step]})
    for a, b in PAIRS["warm"]:
        diff = diff_sites(pass_sites(passes[a], "allocated"), pass_sites(passes[b], "allocated"),
                          by=("function", "inner"))
        records += diff_records(diff, a=a, b=b, of="allocated", case=case_name(mwe, order, f"{a} vs {b}"), **labels,
                                params={**base_params, "step": f"{a} vs {b}"})
    return records


def run_protocol(mwe_name: str, engine_name: str, order: str, *, device="auto",
                 protocol: Protocol = Protocol(), attribute: bool = False) -> list[dict]:
    """The seed's four steps for one MWE, engine and order: tidy records of times, allocations,
    compile counts and gradient checks; with `attribute`, also an attribution pass after them (sites of
    each step's warm call, and the site-by-site diffs of the verdict pairs)."""
    device = resolve_device(device)
    dtype = MWE_DTYPES[mwe_name]
    base_params = dict(mwe=mwe_name, order=order, warmup=protocol.warmup, repeats=protocol.repeats,
                       cold_passes=protocol.cold_passes, alloc_passes=protocol.alloc_passes,
                       alloc_samples=protocol.alloc_samples, seed=protocol.seed, n_samples=N_SAMPLES,
                       batch_size=BATCH_SIZE)
    reason = not_applicable(engine_name, device)
    if reason is not None:
        return [status_record(status=NOT_APPLICABLE, message=reason, benchmark=NAME,
                              case=case_name(mwe_name, order, step), engine=engine_name, device=device, dtype=dtype,
                              params={**base_params, "step": step}) for step in STEPS]
    engine = make_engine(engine_name, device, protocol.backend)
    mwe = MWE(mwe_name, engine, protocol.seed)
    steps = {step: _Step() for step in STEPS}
    for index in range(protocol.cold_passes):
        _timing_pass(mwe, order, steps, warmup=protocol.warmup, repeats=protocol.repeats, keep_grads=index == 0)
    source = ""
    for _ in range(protocol.alloc_passes):
        source = _allocation_pass(mwe, order, steps, warmup=protocol.warmup, alloc_samples=protocol.alloc_samples)
    passes = _attribution_pass(mwe, order, warmup=protocol.warmup) if attribute else None
    engine.reset()
    base_params |= engine.describe() | ({"alloc_source": source} if source else {})
    records = _records(mwe_name, engine_name, order, device, dtype, steps, base_params, protocol.seed)
    if passes is not None:
        records += attribution_records(passes, mwe_name, engine_name, order, device, dtype, base_params)
    return records


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
                floor = {} if a.floor_count is None else {"floor": a.floor_count}  # memray: subtracted from the count
                add(step, f"{phase}_alloc_count", a.count, "count", i, **labels, **floor)
                add(step, f"{phase}_alloc_bytes", a.bytes, "B", i, **labels)
                if a.python_count is not None:  # CPU: memray also traced Python's allocator
                    add(step, f"{phase}_alloc_count_python", a.python_count, "count", i, **labels,
                        floor=a.floor_python_count)
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
    """The allocation tracker's count for an empty call, `samples` times: what is left of it once its floor
    (params.floor, measured in the same session) is subtracted, and the jitter every comparison allows for."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise Refused(f"samples must be an integer >= 1, got {samples!r}")
    device = resolve_device(device)
    records = []
    for i in range(samples):
        allocations = count_allocations(lambda: None, device)
        for metric, value, unit, floor in (("alloc_count", allocations.count, "count", allocations.floor_count),
                                           ("alloc_bytes", allocations.bytes, "B", None),
                                           ("alloc_count_python", allocations.python_count, "count",
                                            allocations.floor_python_count)):
            if value is None:
                continue
            params = {"alloc_source": allocations.source} | ({} if floor is None else {"floor": floor})
            records.append(make_record(benchmark=NAME, case=TRACKER_CASE, tracker=allocations.source,
                                       device=device, dtype="none", metric=metric, value=value, unit=unit,
                                       repeat=i, params=params))
    return records


def run(config, device="auto", *, progress: Callable[[str], None] | None = print) -> list[dict]:
    """Every MWE x engine x order of `config` (this benchmark's checked Config), plus the tracker's own
    jitter: the notebook's records."""
    protocol = Protocol(**{name: config[name] for name in Protocol.__dataclass_fields__ if name in config})
    device = resolve_device(device)
    records = tracker_records(device, protocol.alloc_samples)
    # under `benchlib run --budget`, a combination starts only if it fits at the mean duration so far
    budget = stopping_rule(1, Deadline.from_environment())
    for index, (mwe, engine, order) in enumerate(itertools.product(config.mwes, config.engines, config.orders)):
        if index > 0 and not budget.affords((mwe, engine, order)):
            message = NOT_STARTED_MESSAGE
            records += [status_record(status="not_run", message=message, benchmark=NAME,
                                      case=case_name(mwe, order, step), engine=engine, device=device,
                                      dtype=MWE_DTYPES[mwe], params={"mwe": mwe, "order": order, "step": step})
                        for step in STEPS]
            if progress:
                progress(f"{NAME} {mwe} {engine} {order}: not run: {message}")
            continue
        started = budget.now()
        new = run_protocol(mwe, engine, order, device=device, protocol=protocol,
                           attribute=bool(config.get("attribute", False)))
        budget.add((mwe, engine, order), 0.0, budget.now() - started)
        records += new
        if progress:
            progress(f"{NAME} {mwe} {engine} {order}: {len(new)} records")
    return records
