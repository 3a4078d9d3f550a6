"""`benchlib fit FILE --memory M --scale NAME`: the largest value of an integer parameter (a batch size, a
sequence length) at which a model file's step fits a memory limit, under each engine and combination, and the
fastest engine at the largest value they all reach.

Each named engine's step is measured at `Search.fractions` of the value given (`benchlib.fit.settings`), one fresh
process each, its size model fitted (`benchlib.fit.sizing`), and, where this machine holds the limit, points
measured toward the answer until it lies within `Search.reach` of one (`benchlib.fit.measured`), as one plan of
phases (`benchlib.fit.plan`). The combinations a run adds by default are first predicted from their steps traced
under fake tensors (no memory taken) on the reference engine's measured offset; those whose prediction passes every
measured engine's answer, the frontier, are then measured as the others. The answers are confirmed by measurement
before they are given (`Search.verify`, on by default where this machine holds the limit): the largest value
searched and held in three processes, every other engine's own answer measured once (and searched where it is over),
the fastest engine measured at the value all reach.

On a machine without a GPU, `device="cuda"` predicts instead of measuring (`benchlib.fit.predicted`), and every
line, record and figure says "predicted, not measured on a GPU".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.fit.asking import (FitError, FitInterrupted, MemoryLimit, Question, ask, refuse_below_interpreter,
                                 scale_points)
from benchlib.fit import in_child
from benchlib.fit.pace import Pace
from benchlib.fit.plan import MeasuredFit, carry_out, plan
from benchlib.fit.result import EngineFit, FitResult
from benchlib.fit.settings import THOROUGH, Search
from benchlib.units import format_bytes

__all__ = ["fit"]


def fit(path: str | Path, *, memory: Any, scale: str, device: str = "cpu", engines: Sequence[str] | None = None,
        params: Mapping[str, Any] | None = None, progress: Callable[[str], None] = print,
        search: Search = THOROUGH) -> FitResult:
    """Fit every engine of the model file at `path` (the torch form) to the memory limit `memory` (bytes, or
    "24 GB", "80 GiB"..., or a `MemoryLimit` that keeps a margin free) over the integer parameter `scale`; see the
    module's docstring. Without `engines`, the form's and the combinations `-p combinations` adds (default: the
    ones users reach for). `search.verify` (default: wherever this machine can hold the limit) measures the answers in
    fresh processes before they are given. Every call of the file's code runs in a child, each limited to
    `asking.process_timeout()` (`BENCHLIB_FIT_TIMEOUT`; reading the file: the form check's limit). A prediction is
    made for the card `MemoryLimit.gpu` names (default `cuda_policy.DEFAULT_GPU`). `search` says how hard the measured
    search works (`settings.THOROUGH`, or `settings.QUICK` for a first look)."""
    from benchlib.measure.devices import cuda_without_gpu

    predicted = cuda_without_gpu(device)
    memory, card = gpu_question(memory, predicted, device)
    return fit_asked(ask(path, memory, scale, engines, params, predicted), scale=scale, device=device, card=card,
                     progress=progress, search=search, torch=memory.torch if isinstance(memory, MemoryLimit) else None)


def fit_asked(question: Question, *, scale: str, device: str, card: str | None, progress: Callable[[str], None],
              search: Search, torch: str | None = None) -> FitResult:
    """`fit` of a question already asked (the file read and checked once: `fit --at` falls back to it); a
    prediction is for the card `card` under the torch release `torch` (None: the installed one's)."""
    from benchlib.measure import Device, resolve_device
    from benchlib.measure.isolation import available_memory

    predicted = question.predicted
    model_file, values = question.model_file, question.values
    verify = search.verify
    if predicted and verify:
        raise FitError("--verify measures the best engine on the device, and this machine has no GPU; without "
                       "--verify, --device cuda predicts from a trace under fake tensors")
    scale_points(values[scale], scale, search.fractions)  # a grid of too few values is refused before any work
    target = Device("cuda", int(device.partition(":")[2] or 0)) if predicted else resolve_device(device)
    on_ranks(model_file.world_size, target, predicted)
    refuse_below_interpreter(question, target)
    if verify is None:  # confirmed by default wherever this machine can hold the limit
        verify = not predicted and question.limit <= available_memory(target)
    fits = _applicable(question, target, scale, progress, shapes_only=predicted)
    if predicted:
        result = _predict_all(model_file, fits, values, scale, question.usable, target.name, progress, (card, torch))
        return dataclasses.replace(result, limit=question.limit, margin=question.margin)
    result = FitResult(model_file.name, scale, question.limit, target.name, total_words(target, model_file.world_size),
                       fits, margin=question.margin, world_size=model_file.world_size, per=unit_of(model_file, scale))
    named = [engine_fit for engine_fit in fits if engine_fit.engine not in question.added]
    run = MeasuredFit(question, scale, target, Pace(progress), search, result=result, measuring=named)
    try:
        carry_out(plan(question, verify), run)
    except KeyboardInterrupt as stopped:  # what was measured goes with it, for the command to save
        raise FitInterrupted(result, getattr(stopped, "signal_name", "")) from None
    return result


def unit_of(model_file, scale: str) -> str:
    """What one unit of `scale` is, for a time per unit: a sample where the file's batch grows with it (its reading
    child found so), else a unit of the parameter (a sequence position, a width)."""
    batch = getattr(model_file, "batch_parameters", None)
    return "sample" if (scale in batch if batch is not None else "batch" in scale.lower()) else f"unit of {scale}"


def total_words(target, world_size: int) -> str:
    """What a measured total is, in words: CUDA's reserved peak or the resident high-water mark, the worst rank's."""
    total = "the allocator's reserved peak" if target.is_cuda else "the process's resident high-water mark"
    return total.replace("the process's", "its worst rank's") if world_size > 1 else total


def on_ranks(world_size: int, target, predicted: bool) -> None:
    """FitError where a step on `world_size` ranks cannot run here: each rank is measured on a device of its own
    (predicted on CUDA without a GPU: rank 0 simulated in one process)."""
    from benchlib.measure import rank_devices

    if world_size < 2 or predicted:
        return
    try:
        rank_devices(target, world_size)
    except ValueError as error:
        raise FitError(f"--ranks: {error}") from None


def _applicable(question: Question, device, scale: str, progress: Callable[[str], None], shapes_only: bool = False
                ) -> list[EngineFit]:
    """An `EngineFit` per engine, with the form's reason where it does not apply (`shapes_only`: read from a model on
    the meta device, for a prediction), failed where one of its techniques' own checks raised; an added combination
    that does not apply is left out, as `run` leaves it out, and the line says so."""
    from benchlib.usermodel.case import combination_of

    facts = in_child.engine_facts(question.model_file, question.values, device, question.engines,
                                  question.model_file.world_size, shapes_only)
    reasons = facts.reasons
    fits = []
    for engine in question.engines:
        if engine in facts.failed:  # a fault of the technique, not of the file: failed at any value, never measured
            message = f"failed: {facts.failed[engine]}"
            fits.append(EngineFit(engine, reason=message, failed={question.values[scale]: message}))
            continue
        if engine in question.added and engine in reasons:
            progress(f"{question.model_file.name} {engine}: left out of the combinations fit adds ({reasons[engine]})")
            continue
        multiple = combination_of(question.model_file, engine).batch_multiple
        fits.append(EngineFit(engine, reason=reasons.get(engine, ""), multiple=multiple))
    return fits


def gpu_question(memory: Any, predicted: bool, device: str) -> tuple[Any, str]:
    """The limit and the name of the card a prediction is for: `MemoryLimit.gpu` (`--gpu`) and `.torch` (`--torch`)
    only where fit predicts, and the card's memory where no size is given. Refused, saying what is valid, before any
    work."""
    from benchlib.fit.cuda_policy import DEFAULT_GPU, gpu_named, torch_named

    gpu = memory.gpu if isinstance(memory, MemoryLimit) else None
    for flag, given in (("--gpu", gpu), ("--torch", getattr(memory, "torch", None))):
        if given is not None and not predicted:
            raise FitError(f"{flag} names what a prediction is made for, with --device cuda on a machine without a "
                           f"GPU; with --device {device} fit measures here")
    try:
        card = gpu_named(gpu or DEFAULT_GPU)
        torch_named(getattr(memory, "torch", None))
    except ValueError as error:
        raise FitError(str(error)) from None
    if memory is None or (isinstance(memory, MemoryLimit) and memory.size is None):
        if gpu is None:
            raise FitError("give --memory SIZE (the limit), or --gpu NAME for a prediction at that card's memory")
        memory = MemoryLimit(card.memory_bytes, memory.margin, gpu, memory.torch)
    return memory, gpu or DEFAULT_GPU


def _predict_all(model_file, fits: list[EngineFit], values: dict, scale: str, limit: float, device: str,
                progress: Callable[[str], None], target: tuple[str, str | None]) -> FitResult:
    """`fit`'s answer on a machine without a GPU (`fits`: the engines, with the plan's reasons already set) for the
    card and torch release `target` names: each engine predicted (`predicted.predict_engine`), side by side
    (`in_child.predicted_engines`), and the size model of its traced points recorded with its check error."""
    from benchlib.fit.cuda_policy import emulated
    from benchlib.fit.predicted import BASIS, TRACE_TOLERANCE
    from benchlib.fit.sizing import choose_model
    from benchlib.usermodel.case import combination_of

    unseen: set[str] = set()
    assumed: set[str] = set()
    attention: dict[str, list[str]] = {}
    for engine_fit in fits:
        untraceable = None if engine_fit.reason else combination_of(model_file, engine_fit.engine).untraceable
        if untraceable is not None:
            engine_fit.reason = "not predicted: " + untraceable
    traced = [engine_fit for engine_fit in fits if not engine_fit.reason]
    if len(traced) > 1:
        progress(f"{model_file.name}: tracing {len(traced)} engines, {in_child.trace_workers(len(traced))} at a time "
                 f"on {in_child.usable_cores()} cores")
    predictions = in_child.predicted_engines(model_file, [engine_fit.engine for engine_fit in traced], values, scale,
                                             limit, target)
    for engine_fit in traced:
        made = predictions[engine_fit.engine]
        if "reason" in made:
            engine_fit.reason = made["reason"]
            progress(f"{model_file.name} {engine_fit.engine}: {engine_fit.reason}")
            continue
        engine_fit.traced = {int(value): reserved for value, reserved in made["traced"].items()}
        engine_fit.tolerance = TRACE_TOLERANCE
        unseen.update(made["unseen"])
        assumed.update(made["assumed"])
        if made["attention"]:
            attention[engine_fit.engine] = made["attention"]
        engine_fit.model = choose_model(list(engine_fit.traced), list(engine_fit.traced.values()))
        largest, reach = made["largest"], made["reach"]
        if largest is not None and largest == reach:  # fits at the farthest value traced: the size model says beyond
            largest = engine_fit.model.largest_under(limit, reach) or reach
        engine_fit.max_fitting = largest
        progress(f"{model_file.name} {engine_fit.engine}: traced at {len(engine_fit.traced)} values of {scale}; "
                 f"reserved at {scale}={values[scale]}: {format_bytes(engine_fit.traced[values[scale]])} ({BASIS})")
    total = f"the allocator's reserved peak, {BASIS}"
    if model_file.world_size > 1:
        total = f"rank 0's reserved peak (the largest shard), simulated in one process, {BASIS}"
    return FitResult(model_file.name, scale, limit, device, total, fits, basis=BASIS, unseen=sorted(unseen),
                     target=emulated(*target), assumed=sorted(assumed), attention=attention, world_size=model_file.world_size)
