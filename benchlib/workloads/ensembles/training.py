"""The training loop of one strategy x GC policy x heap cell (through `benchlib.measure.measure_steps`),
the grid of cells, the thread sweep and the GC experiment; `Grid` and `TrainingPlan` say what they run."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from benchlib.errors import Refused
from benchlib.records import make_record
from benchlib.trials.loop import NOT_STARTED_MESSAGE, stopping_rule
from benchlib.trials.stopping import BUDGET, MAX_TRIALS, TRIALS_RUN, Deadline
from benchlib.analysis.derived import step_summaries
from benchlib.workloads.ensembles.config import DEFAULT_POLICY, STRATEGIES, GC_POLICIES, EnsembleConfig, initial_parameters
from benchlib.workloads.ensembles.strategies import Strategy, STRATEGY_CLASSES, make_strategy
from benchlib.workloads.ensembles.cycles import StepCycles
from benchlib.workloads.ensembles.gc_policies import GCPolicy, long_lived_heap, pause_frame, pause_records
from benchlib.workloads.ensembles.common import NAME, load_average, minibatch_indices


@dataclass
class TrainResult:
    """Per-step arrays and run-level figures of one strategy x GC policy x heap cell."""

    strategy: str
    labels: dict  # everything that identifies the cell (config, policy, heap, cycles, data, device...)
    step_s: np.ndarray
    loss: np.ndarray
    warmup: int
    pauses: "pd.DataFrame"  # one row per collection (`pause_frame`: step, generation, counts, tracked objects)
    memory_bytes: np.ndarray  # per step: memory in use after it, above the level before the first step
    cycle_bytes: np.ndarray  # per step: bytes the uncollected reference cycles still hold after it
    alloc_count_per_step: float = math.nan
    alloc_bytes_per_step: float = math.nan
    alloc_count_python_per_step: float = math.nan  # Python-allocator allocations (CPU)
    alloc_bytes_python_per_step: float = math.nan
    alloc_source: str = ""
    peak_bytes: float = math.nan

    @property
    def gc_count(self) -> np.ndarray:
        """Per step: the collections that began in it."""
        return np.bincount(self.pauses["step"].to_numpy(int), minlength=len(self.step_s)).astype(float)

    @property
    def gc_s(self) -> np.ndarray:
        """Per step: seconds of the collections that began in it."""
        return np.bincount(self.pauses["step"].to_numpy(int), weights=self.pauses["pause_s"].to_numpy(float),
                           minlength=len(self.step_s))

    @property
    def gc_generations(self) -> list[tuple]:
        """Per step: the generations of the collections that began in it."""
        by_step = self.pauses.groupby("step")["generation"].apply(tuple)
        return [by_step.get(step, ()) for step in range(len(self.step_s))]

    def statistics(self) -> dict[str, float]:
        """Step-time statistics over the timed steps (`step_summaries`, as results derive them from
        the stored steps) and the measured allocations and peak."""
        steps = {"step_time": self.step_s, "step_gc_time": self.gc_s, "step_gc_pauses": self.gc_count,
                 "step_loss": self.loss, "step_memory": self.memory_bytes}
        if self.labels.get("cycles"):
            steps["step_cycle_bytes"] = self.cycle_bytes
        samples_per_step = self.labels["n_nets"] * self.labels["batch"]
        return step_summaries(steps, warmup=self.warmup, samples_per_step=samples_per_step) | {
            "alloc_count_per_step": self.alloc_count_per_step, "alloc_bytes_per_step": self.alloc_bytes_per_step,
            "alloc_count_python_per_step": self.alloc_count_python_per_step,
            "alloc_bytes_python_per_step": self.alloc_bytes_python_per_step, "peak_bytes": self.peak_bytes}

    def case(self) -> str:
        case = (f"{self.strategy}|gc={self.labels['gc_policy']}|heap={self.labels['heap_objects']}"
                f"|threads={self.labels['torch_threads']}")
        if self.labels.get("cycles"):
            case += f"|cycles={self.labels['cycles']}"
        return f"{case}|sweep={self.labels['sweep']}" if self.labels.get("sweep") else case

    def records(self, device) -> list[dict]:
        """Tidy rows of what was measured: one per step and metric (repeat = step index), and the
        allocation pass and peak. Summaries (median, p99, throughput...) are derived from the steps
        by `benchlib.analysis.derived`, not stored."""
        common = dict(benchmark=NAME, case=self.case(), strategy=self.strategy, device=device,
                      dtype="float32", params=self.labels)
        rows = [make_record(metric=metric, value=value, unit=unit, **common) for metric, value, unit in (
            ("alloc_count_per_step", self.alloc_count_per_step, "count"),
            ("alloc_bytes_per_step", self.alloc_bytes_per_step, "B"),
            ("alloc_count_python_per_step", self.alloc_count_python_per_step, "count"),
            ("alloc_bytes_python_per_step", self.alloc_bytes_python_per_step, "B"), ("peak_bytes", self.peak_bytes, "B"))]
        per_step = [("step_time", "s", self.step_s), ("step_gc_pauses", "count", self.gc_count),
                    ("step_gc_time", "s", self.gc_s), ("step_loss", "", self.loss), ("step_memory", "B", self.memory_bytes)]
        if self.labels.get("cycles"):
            per_step.append(("step_cycle_bytes", "B", self.cycle_bytes))
        for metric, unit, values in per_step:
            rows += [make_record(metric=metric, value=float(v), unit=unit, repeat=i, **common)
                     for i, v in enumerate(values)]
        return rows + pause_records(self.pauses, **common)


@dataclass(frozen=True)
class Grid:
    """Which cells run: every strategy x GC policy x long-lived heap size (samples held as tuples), except that
    a policy other than the default runs only `policy_strategies` where they are given (None: every strategy)."""

    strategies: tuple[str, ...] = STRATEGIES
    gc_policies: tuple[str, ...] = GC_POLICIES
    heap_sizes: tuple[int, ...] = (0,)
    policy_strategies: tuple[str, ...] | None = None

    def strategies_under(self, policy: str) -> tuple[str, ...]:
        """The strategies that run under `policy`, in the grid's order."""
        if policy == DEFAULT_POLICY or self.policy_strategies is None:
            return self.strategies
        return tuple(name for name in self.strategies if name in self.policy_strategies)


@dataclass(frozen=True)
class TrainingPlan:
    """How every cell of a grid trains, whatever its strategy, policy and heap: one value that
    `run_study` builds once from its config and the grid, the sweeps and `train` read, so a setting
    is not handed on by hand through each of them.

    ``steps`` counts the warm-up steps; ``steps_per_strategy`` overrides it for named strategies (a
    per-net step trains the nets one by one and is 20-30x slower; a shorter run of it still shows
    its distribution). ``alloc_steps`` further steps feed the allocation pass. ``manual_every`` and
    ``manual_generation`` configure the manual GC policy. ``trials`` and ``order_seed``: see
    `run_grid`. Every step leaves ``cycles`` reference cycles, and with ``count_tracked`` every
    collection carries the objects it walked (`train`).
    """

    steps: int = 60
    steps_per_strategy: Mapping[str, int] = field(default_factory=dict)
    warmup: int = 5
    alloc_steps: int = 3
    manual_every: int = 10
    manual_generation: int = 2
    trials: int = 1
    order_seed: int | None = 0
    cycles: int = 0
    count_tracked: bool = False

    def __post_init__(self):
        object.__setattr__(self, "steps_per_strategy", MappingProxyType(dict(self.steps_per_strategy)))

    def steps_of(self, strategy: str) -> int:
        return self.steps_per_strategy.get(strategy, self.steps)


def train(
    strategy: Strategy,
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    batches: torch.Tensor,
    *,
    device,
    policy: GCPolicy,
    plan: TrainingPlan = TrainingPlan(),
    labels: dict | None = None,
) -> TrainResult:
    """Run ``len(batches) - plan.alloc_steps`` timed steps under ``policy``, then the allocation pass.

    ``device`` is a `benchlib.measure.Device`. Of ``plan``, only the cell's settings count:
    ``warmup``, ``alloc_steps``, ``cycles`` and ``count_tracked`` (the caller chose the batches).
    The last ``alloc_steps`` rows of ``batches`` feed the allocation pass, so the timed steps see
    the same minibatches whatever ``alloc_steps`` is. Each timed step leaves ``cycles`` reference
    cycles holding its tensors (`StepCycles`). Every collection that begins in a step is recorded;
    with ``count_tracked``, with the tracked objects it walked (the count's list of every object
    briefly raises a CPU peak: about 8 B per object). Memory in use and the bytes the uncollected
    cycles hold are read after each step, outside its time.
    """
    from benchlib.measure import measure_steps
    from benchlib.measure.devices import heap_trim_available

    warmup, alloc_steps, cycles = plan.warmup, plan.alloc_steps, plan.cycles
    steps = len(batches) - alloc_steps
    if steps <= warmup:
        raise Refused(f"need more steps than warm-up steps ({warmup}), got {steps} timed steps")
    loss, memory, held = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    left = StepCycles(cycles)
    labels = dict(labels or {}) | {"warmup": warmup, "loadavg_1m_before": load_average(),
                                   "torch_threads": torch.get_num_threads(), "cycles": cycles}
    if device.kind == "cpu":
        labels["peak_after_malloc_trim"] = heap_trim_available()

    def one_step(step):
        idx = batches[step]
        x = x_all[idx]
        losses = strategy.step(x, y_all[idx])
        left.leave(x, losses)
        policy.after_step(step)
        return losses

    def after_step(step, losses):
        loss[step] = float(losses.mean())
        memory[step], held[step] = device.memory_in_use(), left.held_bytes

    with policy:
        try:
            timed = measure_steps(one_step, steps, device=device, after_step=after_step,
                                  count_tracked=plan.count_tracked)
        finally:
            left.close()
    peak = math.nan if timed.peak_bytes is None else timed.peak_bytes
    pauses = pause_frame([p for step in timed.gc_pauses for p in step],
                         steps=[i for i, step in enumerate(timed.gc_pauses) for _ in step])
    result = TrainResult(strategy.name, labels, np.asarray(timed.step_s, dtype=float), loss, warmup, pauses,
                         memory - timed.baseline_bytes, held, peak_bytes=float(peak))
    if alloc_steps:
        _count_allocations(result, strategy, (x_all, y_all, batches[steps:]), device)
    return result


def _count_allocations(result: TrainResult, strategy: Strategy, extra: tuple, device) -> None:
    """The allocation pass: the steps over `extra`'s batches (x_all, y_all, batch indices) counted, not timed,
    per step into `result`, with where the counts come from."""
    from benchlib.measure import count_allocations

    x_all, y_all, batches = extra

    def allocation_pass():
        for idx in batches:
            strategy.step(x_all[idx], y_all[idx])
        device.synchronize()

    steps = len(batches)
    allocs = count_allocations(allocation_pass, device)
    result.alloc_count_per_step = allocs.count / steps
    result.alloc_bytes_per_step = allocs.bytes / steps
    if allocs.python_count is not None:
        result.alloc_count_python_per_step = allocs.python_count / steps
        result.alloc_bytes_python_per_step = allocs.python_bytes / steps
    result.alloc_source = allocs.source
    result.labels["alloc_source"] = allocs.source


class GridResults(list):
    """The `TrainResult`s of a grid's cells, and in `not_run` the (strategy, gc policy, heap) cells the
    deadline did not reach: what did not run is part of what a grid returns."""

    def __init__(self, *results):
        super().__init__(*results)
        self.not_run: list[tuple[str, str, int]] = []


def run_grid(
    data,
    *,
    device,
    config: EnsembleConfig = EnsembleConfig(),
    grid: Grid = Grid(),
    plan: TrainingPlan = TrainingPlan(),
    sweep: str | None = None,
    progress=None,
    deadline: Deadline | None = None,
) -> "GridResults":
    """Every cell of ``grid``, each from the same initial parameters and batches, ``plan.trials``
    times: within a policy and heap the strategies run in rounds shuffled by ``plan.order_seed``
    (`interleaved_order`), so drift falls on all of them alike; the labels carry `trial`, `trials`,
    `order_seed` and `position`. The allocation pass runs in the first trial only (its counts do not
    drift). Under a ``deadline`` (`benchlib run --budget`), the policy x heap groups share the time
    left; the first group's first round always runs, a later group's first round cell only if the time
    left affords it at that strategy's mean in the groups before (else its (strategy, gc policy, heap) is
    in the results' ``not_run``), and a later trial only if it fits at the group's mean so far.

    ``sweep`` names a side experiment (e.g. "threads") in the labels and case names, so its cells
    never share a case name with the main grid's. ``progress`` is called with each finished result.
    """
    from benchlib.analysis.stats import interleaved_order

    _check_grid(grid, plan)
    cells = _Cells.of(data, device, config, plan, grid, sweep)
    results, groups = GridResults(), len(grid.heap_sizes) * len(grid.gc_policies)
    deadline = deadline or Deadline()
    first_rounds: dict[str, list[float]] = {}  # seconds of each strategy's first-round cells, across groups
    for heap_size in grid.heap_sizes:
        with long_lived_heap(data, heap_size):
            for policy_name in grid.gc_policies:
                budget = stopping_rule(plan.trials, deadline.share(groups))
                groups -= 1
                crossed = grid.strategies_under(policy_name)
                order = interleaved_order(list(crossed), plan.trials, seed=plan.order_seed)
                for position, name in enumerate(order):
                    trial = position // len(crossed)
                    if trial > 0 and not budget.affords(name):
                        continue
                    if trial == 0 and first_rounds.get(name) and deadline.left() < np.mean(first_rounds[name]):
                        results.not_run.append((name, policy_name, heap_size))
                        continue
                    started = budget.now()
                    result = cells.train(name, policy_name, heap_size, (trial, position))
                    results.append(result)
                    budget.add(name, 0.0, budget.now() - started)
                    if trial == 0:
                        first_rounds.setdefault(name, []).append(budget.now() - started)
                    if progress is not None:
                        progress(result)
    return results


def _check_grid(grid: Grid, plan: TrainingPlan) -> None:
    """ValueError, saying what is valid, for a grid or plan that names what does not exist or cannot run."""
    unknown = [s for s in grid.strategies if s not in STRATEGY_CLASSES]
    if unknown:
        raise Refused(f"unknown strategies {unknown}; valid: {', '.join(STRATEGIES)}")
    bad_policies = [p for p in grid.gc_policies if p not in GC_POLICIES]
    if bad_policies:
        raise Refused(f"unknown GC policies {bad_policies}; valid: {', '.join(GC_POLICIES)}")
    bad_heaps = [h for h in grid.heap_sizes if not isinstance(h, int) or h < 0]
    if bad_heaps:
        raise Refused(f"heap sizes must be integers >= 0 (samples held as tuples), got {bad_heaps}")
    if set(plan.steps_per_strategy) - set(STRATEGIES):
        raise Refused(f"steps_per_strategy names unknown strategies; valid: {', '.join(STRATEGIES)}")
    for name in grid.strategies:
        if plan.steps_of(name) <= plan.warmup:
            raise Refused(f"{name}: steps must exceed warmup ({plan.warmup})")


@dataclass(frozen=True)
class _Cells:
    """What every cell of a grid starts from: the data on the device, the initial parameters, the batches (the
    longest strategy's, then the allocation pass's), and the settings its labels carry."""

    data: Any
    device: Any
    config: EnsembleConfig
    plan: TrainingPlan
    sweep: str | None
    tensors: tuple  # x_all, y_all, all_batches
    init: Any
    longest: int

    @classmethod
    def of(cls, data, device, config: EnsembleConfig, plan: TrainingPlan, grid: Grid, sweep: str | None) -> _Cells:
        _use_vmap_once()
        x_all, y_all = data.as_float_tensors(device.torch)
        longest = max(plan.steps_of(s) for s in grid.strategies)
        batches = minibatch_indices(len(data), config.batch, longest + plan.alloc_steps, config.seed).to(device.torch)
        return cls(data, device, config, plan, sweep, (x_all, y_all, batches), initial_parameters(config), longest)

    def train(self, name: str, policy_name: str, heap_size: int, at: tuple[int, int]) -> TrainResult:
        """One cell (`at`: its trial and position in the order), trained from the shared start, its strategy
        closed after; the allocation pass in the first trial only (its counts do not drift)."""
        (trial, position), plan, config, device = at, self.plan, self.config, self.device
        x_all, y_all, all_batches = self.tensors
        n_steps = plan.steps_of(name)
        cell_plan = replace(plan, alloc_steps=plan.alloc_steps if trial == 0 else 0)
        batches = torch.cat([all_batches[:n_steps], all_batches[self.longest:self.longest + cell_plan.alloc_steps]])
        strategy = make_strategy(name, self.init, config, device)
        policy = GCPolicy(name=policy_name, every=plan.manual_every, generation=plan.manual_generation,
                          cuda=device.kind == "cuda")
        labels = asdict(config) | self.data.describe() | policy.describe() | {
            "strategy": name, "optimizer": strategy.optimizer, "heap_objects": heap_size,
            "steps": n_steps, "warmup": plan.warmup, "alloc_steps": cell_plan.alloc_steps,
            "params_per_net": config.params_per_net, "sweep": self.sweep,
            "device": device.name, "trial": trial, "trials": plan.trials, "order_seed": plan.order_seed,
            "position": position,
        }
        try:
            return train(strategy, x_all, y_all, batches, device=device, policy=policy, plan=cell_plan, labels=labels)
        finally:
            strategy.close()


def not_run_records(cells: Sequence[tuple[str, str, int]], device, labels: dict) -> list[dict]:
    """A `not_run` status record per grid cell the --budget did not reach (`GridResults.not_run`), named
    as its case would have been, so the run lists what it could not afford."""
    from benchlib.records import status_record

    threads = torch.get_num_threads()
    return [status_record(status="not_run", message=NOT_STARTED_MESSAGE,
                          benchmark=NAME, case=f"{strategy}|gc={policy}|heap={heap}|threads={threads}",
                          strategy=strategy, device=device, dtype="float32",
                          params={**labels, "strategy": strategy, "gc_policy": policy, "heap_objects": heap})
            for strategy, policy, heap in cells]


def trials_run_records(results: Sequence[TrainResult], trials: int, device) -> list[dict]:
    """One `trials_run` record per cell of a grid: the trials it ran and why no more (`max_trials`, or
    `budget` where `run_grid`'s deadline stopped it early)."""
    counts = Counter((result.case(), result.strategy) for result in results)
    first = {(result.case(), result.strategy): result for result in reversed(results)}
    return [make_record(benchmark=NAME, case=case, strategy=strategy, device=device, dtype="float32",
                        metric=TRIALS_RUN, value=float(count), unit="count",
                        params={**first[case, strategy].labels, "stop": MAX_TRIALS if count >= trials else BUDGET})
            for (case, strategy), count in counts.items()]


def thread_sweep(
    data,
    *,
    device,
    thread_counts,
    config: EnsembleConfig = EnsembleConfig(),
    strategy: str = "batched_fused",
    gc_policy: str = "freeze",
    plan: TrainingPlan = TrainingPlan(steps=200),
    progress=None,
) -> list[TrainResult]:
    """One cell at several torch intra-op thread counts, trained as ``plan`` says but without the
    allocation pass and with no long-lived heap.

    A step of a few milliseconds can wait on a thread pool's wake-up, which a busy or small
    machine delays now and then: that moves p99, not the median, so the fastest strategy's
    spread is worth measuring against the thread count. torch's setting is restored afterwards.
    """
    bad = [n for n in thread_counts if not isinstance(n, int) or n < 1]
    if bad or not thread_counts:
        raise Refused(f"thread_counts must be a non-empty list of integers >= 1, got {list(thread_counts)}")
    from benchlib.measure import torch_threads

    cell = Grid(strategies=(strategy,), gc_policies=(gc_policy,), heap_sizes=(0,))
    results = []
    for count in thread_counts:
        with torch_threads(count):
            results += run_grid(data, device=device, config=config, grid=cell, plan=replace(plan, alloc_steps=0),
                                sweep="threads", progress=progress)
    return results


def cycle_sweep(
    data,
    *,
    device,
    cycle_counts,
    config: EnsembleConfig = EnsembleConfig(),
    grid: Grid = Grid(strategies=("naive", "batched_hand")),
    plan: TrainingPlan = TrainingPlan(steps=200),
    progress=None,
) -> list[TrainResult]:
    """The GC experiment: the cells of ``grid`` (the study's: its cycle strategies under every GC
    policy over the largest long-lived heap) with each step leaving each of `cycle_counts`
    reference cycles (`StepCycles`), every collection with the tracked objects it walked; trained
    as ``plan`` says, without the allocation pass.

    Training code that leaves cycles holding tensors depends on the cyclic collector to free them:
    this shows what each policy then does to step times (pauses), to memory (what the uncollected
    cycles hold between collections) and to the pauses' length against the objects they walk.
    Trials alternate the order of the cycle counts (0, 20 | 20, 0 | ...), so drift between the
    blocks falls on every count alike."""
    bad = [n for n in cycle_counts if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if bad or not cycle_counts:
        raise Refused(f"cycle_counts must be a non-empty list of integers >= 0, got {list(cycle_counts)}")
    results = []
    for trial in range(plan.trials):
        order_seed = None if plan.order_seed is None else plan.order_seed + trial
        for count in (cycle_counts if trial % 2 == 0 else cycle_counts[::-1]):
            cells = run_grid(data, device=device, config=config, grid=grid, sweep="cycles", progress=progress,
                             plan=replace(plan, alloc_steps=0, trials=1, order_seed=order_seed, cycles=count,
                                          count_tracked=True))
            for cell in cells:
                cell.labels |= {"trial": trial, "trials": plan.trials}
            results += cells
    return results


def _use_vmap_once() -> None:
    """Call ``torch.func.vmap`` once before any cell. From its first use in a process on, torch
    makes one more allocation per operator call (memray: about 10,000 more per naive step of
    200 nets), so without this the cells before the first ``batched_vmap`` cell would count
    fewer allocations than the same cells after it."""
    torch.func.vmap(torch.neg)(torch.zeros(1, 1))


def summary_frame(results: list[TrainResult]):
    """One row per cell: strategy, policy, heap, data and the summary metrics (a table to show)."""
    import pandas as pd

    rows = [{"strategy": r.strategy, "gc_policy": r.labels["gc_policy"], "heap_objects": r.labels["heap_objects"],
             "torch_threads": r.labels["torch_threads"], "cycles": r.labels.get("cycles", 0), "data": r.labels["data"],
             "trial": r.labels.get("trial", 0), **r.statistics()} for r in results]
    return pd.DataFrame(rows)


CELL_KEYS = ["strategy", "gc_policy", "heap_objects", "torch_threads", "cycles", "data"]


def cell_medians(per_trial) -> "pd.DataFrame":
    """`summary_frame` rows folded over trials: each cell's median of every metric (the allocation
    pass, run in the first trial only, keeps its one value) and `trials`, in the cells' order."""
    grouped = per_trial.groupby(CELL_KEYS, sort=False)
    medians = grouped.median(numeric_only=True).drop(columns=["trial"])
    return medians.assign(trials=grouped.size()).reset_index()


def steps_frame(results: list[TrainResult]):
    """One row per step of every cell (step, time, GC pauses and their generations, loss)."""
    import pandas as pd

    frames = []
    for r in results:
        frames.append(pd.DataFrame({
            "strategy": r.strategy, "gc_policy": r.labels["gc_policy"], "heap_objects": r.labels["heap_objects"],
            "data": r.labels["data"], "trial": r.labels.get("trial", 0), "step": np.arange(len(r.step_s)),
            "step_s": r.step_s,
            "gc_count": r.gc_count, "gc_s": r.gc_s,
            "gc_generations": [",".join(map(str, g)) for g in r.gc_generations],
            "loss": r.loss, "warmup": np.arange(len(r.step_s)) < r.warmup,
            "cycles": r.labels.get("cycles", 0), "memory_bytes": r.memory_bytes, "cycle_bytes": r.cycle_bytes,
        }))
    return pd.concat(frames, ignore_index=True)


def pauses_frame(results: list[TrainResult]):
    """Every collection of every cell, one row each, with the cell's labels: what the pause-against-
    tracked-objects figure draws beside the `gc.collect()` experiment."""
    import pandas as pd

    frames = [r.pauses.assign(strategy=r.strategy, gc_policy=r.labels["gc_policy"], heap_objects=r.labels["heap_objects"],
                              cycles=r.labels.get("cycles", 0), trial=r.labels.get("trial", 0), data=r.labels["data"],
                              warmup=r.warmup)
              for r in results if len(r.pauses)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
