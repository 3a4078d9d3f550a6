"""The mnist_ensembles notebook's whole measurement from its config: the grid, the FLOP floor, the
full-collection pauses, LeNet5, the thread sweep and the GC experiment (reference cycles), as records
and the frames its figures need."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pandas as pd
import torch

from benchlib.measure import torch_threads
from benchlib.trials.loop import NOT_STARTED_MESSAGE
from benchlib.trials.stopping import Deadline
from benchlib.workloads.ensembles import lenet
from benchlib.workloads.ensembles.common import NAME
from benchlib.workloads.ensembles.config import PER_NET_STRATEGIES, EnsembleConfig
from benchlib.workloads.ensembles.floor import calibration_flop_rate, flop_floor, flop_floor_records, matmul_flops
from benchlib.workloads.ensembles.gc_policies import collection_pause_records, full_collection_pauses
from benchlib.workloads.ensembles.training import (
    Grid, TrainingPlan, cell_medians, cycle_sweep, pauses_frame, run_grid, steps_frame, summary_frame, thread_sweep,
    trials_run_records, not_run_records,
)


@dataclass
class Study:
    """What the notebook shows: every record, and the frames of its figures and tables."""

    records: list = field(default_factory=list)
    summary: pd.DataFrame | None = None  # one row per cell: medians over trials
    trials: pd.DataFrame | None = None  # one row per cell and trial
    steps: pd.DataFrame | None = None
    floor: dict = field(default_factory=dict)
    flop_source: str = ""
    pauses: pd.DataFrame | None = None  # gc.collect() over each long-lived heap: one row per pause
    lenet: pd.DataFrame | None = None
    threads: pd.DataFrame | None = None
    cycles: pd.DataFrame | None = None  # the GC experiment: one row per cell and trial
    cycle_steps: pd.DataFrame | None = None
    cycle_pauses: pd.DataFrame | None = None  # the GC experiment's collections, with the objects each walked
    not_run: dict = field(default_factory=dict)  # a later phase the --budget did not reach -> why (its frames None)


def progress_line(result) -> str:
    """One finished cell: median / p99 / max step time, throughput and GC share."""
    s = result.statistics()
    return (f"{result.case():45s} median {s['step_time_median'] * 1e3:8.2f} ms  p99 {s['step_time_p99'] * 1e3:8.2f} ms  "
            f"max {s['step_time_max'] * 1e3:8.2f} ms  {s['throughput']:10.4g} model-samples/s  "
            f"gc {100 * s['gc_share']:.2f}%  data={result.labels['data']}")


def run_study(config: Any, data, *, device, calibration: pd.DataFrame | None = None,
              save: Callable[[list], Any] | None = None, progress: Callable[[str], None] = print) -> Study:
    """Everything the notebook measures, from its (already validated) `MnistEnsemblesConfig`.

    `calibration` is the run's records so far: the FLOP floor uses their matmul rate when the
    calibration notebook ran first, else one 1024x1024 product measured here. `save` gets the
    records so far after each part, so a later failure loses nothing already measured.
    A non-zero `config.torch_threads` fixes torch's intra-op thread count for the study.
    """
    with torch_threads(config.torch_threads) if config.torch_threads else nullcontext():
        return _measure_study(config, data, device=device, calibration=calibration, save=save, progress=progress)


def training_plan(config: Any) -> TrainingPlan:
    """The study's `TrainingPlan`, from its config: the per-net strategies get `per_net_steps` (a grid
    ignores the strategies it does not run, so one plan serves the main grid and the GC experiment)."""
    return TrainingPlan(steps=config.steps, steps_per_strategy={s: config.per_net_steps for s in PER_NET_STRATEGIES},
                        warmup=config.warmup, alloc_steps=config.alloc_steps, manual_every=config.manual_every,
                        manual_generation=config.manual_generation, trials=config.trials, order_seed=config.seed)


def _phase_reached(study: Study, phase: str, deadline: Deadline, variants: dict, device, labels: dict,
                   progress) -> bool:
    """Whether the notebook's --budget leaves time to start `phase`; when not, the phase is `not run` (a
    status record for each of its `variants`, {dimension: names}), said, and its frames stay None."""
    if deadline.left() > 0:
        return True
    from benchlib.records import status_record

    reason = NOT_STARTED_MESSAGE
    study.not_run[phase] = reason
    study.records += [status_record(status="not_run", message=reason, benchmark=NAME, case=phase, device=device.name,
                                    dtype="float32", params={**labels, "phase": phase}, **{dimension: name})
                      for dimension, names in variants.items() for name in names]
    progress(f"{phase}: not run: {reason}")
    return False


def _main_grid(study: Study, results, plan: TrainingPlan, device, labels: dict, progress) -> None:
    """The main grid's results in `study`: its trials, steps and per-cell medians, and its records (with each
    cell the budget left unrun said)."""
    skipped = results.not_run
    study.trials, study.steps = summary_frame(results), steps_frame(results)
    study.summary = cell_medians(study.trials)
    study.records += [row for result in results for row in result.records(device)]
    study.records += trials_run_records(results, plan.trials, device)
    study.records += not_run_records(skipped, device, labels)
    for strategy, policy, heap in skipped:
        progress(f"{strategy}|gc={policy}|heap={heap}: not run: {NOT_STARTED_MESSAGE}")


def _floor(study: Study, ensemble: EnsembleConfig, calibration, device, labels: dict) -> None:
    """The arithmetic floor of one training step, from this run's calibration where it measured the FLOP rate
    (else a matmul measured here), at the training's thread count."""
    threads = torch.get_num_threads()  # the training's: the floor is taken at the same count
    flop_rate = calibration_flop_rate(calibration, device.name, threads=threads if device.kind == "cpu" else None)
    study.flop_source = "calibration records of this run" if flop_rate else "matmul 1024x1024 measured here"
    study.floor = flop_floor(ensemble, flop_rate or matmul_flops(device))
    study.records += flop_floor_records(study.floor, device, labels | {"flop_source": study.flop_source,
                                                                       "torch_threads": threads})


def _measure_study(config: Any, data, *, device, calibration, save, progress) -> Study:
    ensemble = EnsembleConfig(n_nets=config.n_nets, hidden=config.hidden, batch=config.batch, seed=config.seed)
    plan = training_plan(config)
    study, labels = Study(), {"data": data.source, "device": device.name}
    shown = lambda result: progress(progress_line(result))  # noqa: E731
    grid = Grid(strategies=config.strategies, gc_policies=config.gc_policies, heap_sizes=config.heap_sizes,
                policy_strategies=config.policy_strategies)
    # under --budget, the main grid's later trials get half the notebook's time; each later phase starts only
    # while time is left (one that cannot is `not run`, its figures and tables left out)
    notebook = Deadline.from_environment()
    results = run_grid(data, device=device, config=ensemble, grid=grid, plan=plan, progress=shown,
                       deadline=notebook.share(2))
    _main_grid(study, results, plan, device, labels, progress)
    if save is not None:
        save(study.records)

    _floor(study, ensemble, calibration, device, labels)

    reached = lambda phase, variants: _phase_reached(study, phase, notebook, variants, device, labels, progress)  # noqa: E731
    if reached("gc.collect", {"collector": ["python-gc"]}):
        study.pauses = full_collection_pauses(data, heap_sizes=config.pause_heap_sizes, repeats=config.pause_repeats)
        study.records += collection_pause_records(study.pauses, device, labels)
        if save is not None:
            save(study.records)

    if reached("lenet5", {"mode": list(config.lenet_modes)}):
        epochs, lenet_labels = lenet.run_lenet(
            data, device=device, config=lenet.LeNetConfig(epochs=config.lenet_epochs, step_limit=config.lenet_step_limit,
                                                          seed=config.seed), modes=config.lenet_modes,
            progress=lambda mode, r: progress(f"{mode:10s} epoch {r.epoch}: {r.at_time()}"))
        study.records += lenet.lenet_records(epochs, lenet_labels, device)
        if save is not None:
            save(study.records)
        study.lenet = lenet.lenet_frame(epochs, lenet_labels)

    # each thread count runs one trial (its labels: trials=1, order_seed=0)
    if reached("threads", {"strategy": ["batched_fused"]}):
        threaded = thread_sweep(data, device=device, config=ensemble, thread_counts=config.thread_counts,
                                plan=replace(plan, trials=1, order_seed=0), progress=shown)
        study.records += [row for result in threaded for row in result.records(device)]
        if save is not None:
            save(study.records)
        study.threads = summary_frame(threaded)

    if reached("cycles", {"strategy": list(config.cycle_strategies)}):
        cycle_grid = Grid(strategies=config.cycle_strategies, gc_policies=config.gc_policies,
                          heap_sizes=(max(config.heap_sizes),))
        cycled = cycle_sweep(data, device=device, config=ensemble, cycle_counts=config.cycles, grid=cycle_grid,
                             plan=plan, progress=shown)
        study.records += [row for result in cycled for row in result.records(device)]
        study.cycles, study.cycle_steps, study.cycle_pauses = summary_frame(cycled), steps_frame(cycled), pauses_frame(cycled)
    if save is not None:
        save(study.records)
    return study
