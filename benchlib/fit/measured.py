"""The measured path: each engine's step measured in fresh processes at a few values of the parameter, its size
model fitted, points measured toward the answer until it lies within `Search.reach` of one, and the answer confirmed
by measurement (`confirm`) before it is given: each search its own proposals, driven by `benchlib.fit.search.drive`."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchlib.fit.asking import DEFAULT_TIMEOUT_S
from benchlib.fit.pace import Pace
from benchlib.fit.result import EngineFit
from benchlib.fit.settings import THOROUGH, Search
from benchlib.fit.search import SEARCH_LIMIT, Bracketing, Toward, drive, multiple_of
from benchlib.fit.sizing import (GROWTH_RESOLUTION, TRACE_TRUSTED, choose_model, grows, trace_model,
                                 trace_values)
from benchlib.records.metrics import CUDA_RESERVED_PEAK
from benchlib.units import format_bytes, format_seconds

WARMUP = 1
# A training process runs with the allocator the user's environment gives it, not the fixed mmap threshold `run`
# measures peaks under (which returns freed buffers at once), and nobody hands its heap back between steps: its
# resident high-water over its whole life is what must fit. Measured under `run`'s policy, a small ViT's eager step at
# batch 256 read 900 MB where a lean process of its own reached 1077 MB; under glibc's defaults with the heap handed
# back before the measured steps, a ConvMixer's read 1.057 GB at batch 573 where a lean process needed 1165 MB at 561.
USERS_ALLOCATOR = "training-process"
FAILED = "failed: "  # how `measure_step` begins the reason of a step that failed (raised, killed, timed out)
DEEP = 64  # module levels a step's memory by module is kept to when asked for (`by_module`): every block apart

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StepOutcome:
    """What one measured step came to (`measure_step`): its total bytes and median seconds per step, or why it has
    none (`reason`; it begins with `FAILED` where the user's code failed). A step ended at its resident cap has the
    total it held then and NaN seconds."""

    total: int = 0
    seconds: float = math.nan
    reason: str = ""

    @property
    def measured(self) -> bool:
        return not self.reason

    @property
    def failed(self) -> bool:
        return self.reason.startswith(FAILED)


Measure = Callable[[int], StepOutcome]  # one engine's step at a value of the scale, in a fresh process


def measure_step(model_file, engine: str, values: dict, device, steps: int = THOROUGH.steps,
                 by_module: list | None = None, cap_bytes: int | None = None,
                 isolate: Callable | None = None) -> StepOutcome:
    """(total bytes, median seconds per step over `steps` after a warm-up) of one engine's step at `values`, in a
    fresh process run as a training process runs (`USERS_ALLOCATOR`), or why not; on several ranks
    (`model_file.world_size`), every rank a fresh process and the total its worst rank's. Given `by_module`, the step's
    memory by module to `DEEP` levels (its `module_bytes` rows) is added to it. Given `cap_bytes`, the process ends
    itself once its resident memory passes it, and the total is what it held then (over the cap; NaN seconds).
    `isolate` runs the one process as `run_isolated` (the default) does."""
    from benchlib.measure import (CaseCapped, CaseFailed, CaseNotApplicable, IsolationOptions, rank_devices,
                                  run_isolated, run_ranks)
    from benchlib.usermodel.measuring import RANKED_TARGET, TARGET, TORCH_FORM, preload

    # memory by module is made by the check after the measured steps; without it, the check would be thrown away
    depth = {"module_depth": DEEP} if by_module is not None else {"check": "none"}
    options = IsolationOptions(warmup=WARMUP, repeats=steps, timeline=False, malloc=USERS_ALLOCATOR,
                               rss_cap_bytes=cap_bytes, timeout_s=getattr(model_file, "timeout_s", DEFAULT_TIMEOUT_S),
                               preload=preload(TORCH_FORM, model_file, engine, device))
    world_size = getattr(model_file, "world_size", 1)
    with tempfile.TemporaryDirectory(prefix="benchlib-fit-") as gradients:
        try:
            if world_size > 1:  # every rank at once: the total is its worst rank's
                result = run_ranks(RANKED_TARGET, {"path": str(model_file.path), "engine": engine, "values": values,
                                                   "checked": False},
                                   name=f"{model_file.name}/{engine}", world_size=world_size,
                                   devices=rank_devices(device, world_size), options=options)
            else:
                result = (isolate or run_isolated)(
                    TARGET, {"path": str(model_file.path), "engine": engine, "values": values, "gradient_dir": gradients,
                             **depth},
                    name=f"{model_file.name}/{engine}", device=device.name, options=options)
        except CaseNotApplicable as refused:
            return StepOutcome(reason=f"not applicable: {refused.reason}")
        except CaseCapped as capped:  # over the cap, so over the limit: what it held is a total past it
            return StepOutcome(capped.resident)
        except CaseFailed as failed:
            return StepOutcome(reason=f"{FAILED}{failed.reason}")
    if by_module is not None:
        by_module += result.breakdown
    measurement = result.measurement
    if device.is_cuda:
        return StepOutcome(int(measurement.cuda_allocator[CUDA_RESERVED_PEAK]), measurement.median_s)
    return StepOutcome(int((measurement.baseline_bytes or 0) + (measurement.peak_bytes or 0)), measurement.median_s)


def fit_model(engine_fit: EngineFit, model_file, values: dict, scale: str, progress: Progress) -> None:
    """The engine's size model over its measured points: the better of linear and quadratic, or the trace model
    where it predicts the largest measured total within `TRACE_TRUSTED`."""
    engine_fit.model = choose_model([v for v, _, _ in engine_fit.points], [t for _, t, _ in engine_fit.points])
    if not engine_fit.untraced:  # a step torch could not trace, or never traces, is not tried again
        _trace(engine_fit, model_file, values, scale, progress)


def _trace(engine_fit: EngineFit, model_file, values: dict, scale: str, progress: Progress) -> None:
    """Trace the engine's step (`traced_peak`, in a child: `in_child.traced_peaks`) and take the trace model where it
    predicts within `TRACE_TRUSTED`; where torch cannot trace it, say why and keep the measured points' model."""
    from benchlib.fit import in_child
    from benchlib.usermodel.case import combination_of

    untraceable = combination_of(model_file, engine_fit.engine).untraceable
    if untraceable is not None:
        engine_fit.untraced = untraceable
        return
    points = [(v, total) for v, total, _ in engine_fit.points]
    missing = [value for value in trace_values(points) if value not in engine_fit.traced]  # each traced once
    if missing:  # one process, silent until it ends: said first, with how long it may take
        limit = getattr(model_file, "timeout_s", None)
        progress(f"{model_file.name} {engine_fit.engine}: tracing at {scale}={', '.join(map(str, missing))} under fake "
                 f"tensors, in one process{f' (at most {limit:g} s)' if limit else ''}")
        traced, untraced = in_child.traced_peaks(model_file, engine_fit.engine, values, scale, missing)
        if untraced is not None:
            engine_fit.untraced, engine_fit.traced = untraced, {}
            progress(f"{model_file.name} {engine_fit.engine}: not traced ({engine_fit.untraced})")
            return
        engine_fit.traced.update(traced)
    model, traced = trace_model(points, engine_fit.traced.__getitem__)
    progress(f"{model_file.name} {engine_fit.engine}: traced at {len(traced)} values of {scale} up to {max(traced)}; "
             f"the trace model predicted the largest measured total within {100 * model.check_error:.1f}%")
    if model.check_error <= TRACE_TRUSTED:
        engine_fit.model = model


@dataclass
class MeasuredSearch:
    """What the phases of a measured fit share (`benchlib.fit.plan`): the question, where it is measured, how hard,
    the progress line, and each engine's step measured in a fresh process (`step`)."""

    question: Any  # asking.Question
    scale: str
    device: Any
    pace: Pace
    search: Search = THOROUGH

    @property
    def model_file(self):
        return self.question.model_file

    @property
    def usable(self) -> float:
        return self.question.usable

    def step(self, engine_fit: EngineFit, value: int, cap_bytes: int | None = None, planned: bool = False
             ) -> StepOutcome:
        """The engine's step at `value` of the scale, in a fresh process, counted by the progress line (`planned`:
        already, with the phase's other processes)."""
        if not planned:
            self.pace.expect([value], searching=True)
        return measure_step(self.model_file, engine_fit.engine, {**self.question.values, self.scale: value},
                            self.device, steps=self.search.steps, cap_bytes=cap_bytes)

    def named(self, engine_fit: EngineFit, value: int) -> str:
        return f"{self.model_file.name} {engine_fit.engine} {self.scale}={value}"


def farther_out(run: MeasuredSearch, engine_fit: EngineFit) -> None:
    """Where the totals measured do not rise past the measurement's resolution (`sizing.grows`), points farther out
    (`flat_reach` times the largest, `flat_steps` at most) until they do: a slope read from noise can say any value
    fits, or turn negative. A value whose batch alone would take the step past the limit, or past what this machine
    has, is not measured. Where the totals still do not grow, `flat` says so, with the value at which the batch alone
    would reach the limit, and the answer is the largest value measured (`EngineFit.answer`)."""
    from benchlib.fit import in_child
    from benchlib.measure.isolation import available_memory

    search, limit, scale = run.search, run.usable, run.scale
    if grows(_totals(engine_fit)):
        return
    (below, _), (largest, _) = _totals(engine_fit)[-2:]
    per_unit = (in_child.batch_bytes(run.model_file, run.question.values, scale, largest)
                - in_child.batch_bytes(run.model_file, run.question.values, scale, below)) / (largest - below)
    room = min(limit, available_memory(run.device))

    def proposals() -> Iterator[int]:
        for _ in range(search.flat_steps):
            largest, total = max(_totals(engine_fit))
            value = multiple_of(largest * search.flat_reach, engine_fit.multiple)
            if total + per_unit * (value - largest) > room or grows(_totals(engine_fit)):
                return
            yield value

    def probe(value: int) -> bool:
        outcome = run.step(engine_fit, value)
        run.pace.done(f"{run.named(engine_fit, value)} (farther out: the totals did not grow): " + (outcome.reason or (
            f"{format_bytes(outcome.total)}, {format_seconds(outcome.seconds)}/step")), value)
        if outcome.failed:
            engine_fit.failed[value] = outcome.reason
        if outcome.measured:
            engine_fit.points.append((value, outcome.total, outcome.seconds))
        return outcome.measured

    drive(proposals(), probe)
    points = _totals(engine_fit)
    if grows(points):
        return
    low, high = points[0], max(points)
    reach = "" if per_unit <= 0 or high[1] >= limit else (f"; its batch alone would take it to the limit at {scale}="
                                      f"{int(high[0] + (limit - high[1]) / per_unit)}")
    engine_fit.flat = (f"its total does not measurably grow from {scale}={low[0]} to {high[0]} ({format_bytes(low[1])} "
                       f"to {format_bytes(high[1])}: less than the {100 * GROWTH_RESOLUTION:.0f}% fresh processes' "
                       f"totals vary), so no size model is read past what was measured{reach}")


def toward_answer(run: MeasuredSearch, engine_fit: EngineFit) -> None:
    """Measured points grow toward the answer: while it lies more than `reach` times past the largest measured
    value, the next point is measured where the answer lies a little less than `reach` times past it (one step,
    not one per doubling, where the prediction holds) in a fresh process and the size model is fitted again. Where
    this machine cannot hold the next point, or its measurement fails, `unmeasured` says so and the answer stays an
    extrapolation."""
    from benchlib.measure.isolation import available_memory

    search, limit = run.search, run.usable
    available = available_memory(run.device)
    if limit > available:  # the answer could not be measured here anyway: the line says how far it extrapolated
        engine_fit.unmeasured = (f"the limit is above the {format_bytes(available)} {run.device.name} has available, "
                                 "so the points stop at the value given")
        return

    def proposals() -> Iterator[int]:
        while True:
            answer = engine_fit.answer(limit)
            largest = max(value for value, _, _ in engine_fit.points)
            if answer is None or answer >= SEARCH_LIMIT or answer <= search.reach * largest:
                return
            # an answer that grows as the model learns from the new point stays within reach of it (no creeping by
            # ones); its predicted total is under the limit, which this machine holds
            yield multiple_of(math.ceil(answer / (search.reach * search.approach_slack)), engine_fit.multiple)

    def probe(value: int) -> bool:
        answer = engine_fit.answer(limit)
        outcome = run.step(engine_fit, value)
        if not outcome.measured:
            engine_fit.unmeasured = f"{run.scale}={value}: {outcome.reason}"
            if outcome.failed:
                engine_fit.fail(value, outcome.reason, limit)
            run.pace.done(f"{run.named(engine_fit, value)}: {outcome.reason}", value)
            return False
        engine_fit.points.append((value, outcome.total, outcome.seconds))
        run.pace.done(f"{run.named(engine_fit, value)}: {format_bytes(outcome.total)}, "
                      f"{format_seconds(outcome.seconds)}/step (toward the answer, predicted {answer})", value)
        fit_model(engine_fit, run.model_file, run.question.values, run.scale, run.pace.say)
        return True

    drive(proposals(), probe)


def confirm(engine_fit: EngineFit, measure: Measure, scale: str, limit: float,
            affordable: float, progress: Progress, search: Search = THOROUGH) -> None:
    """The engine measured at its predicted answer, then the largest value whose measured total stays under `limit`
    searched by measurement (`largest_measured`): `checked` holds every total, `confirmed` the answer, left None
    where the machine cannot hold the answer or a measurement failed."""
    value = engine_fit.max_fitting
    predicted = engine_fit.model(value)
    if value >= SEARCH_LIMIT or predicted > affordable:
        progress(f"confirming {engine_fit.engine} at {scale}={_named(value)} needs {format_bytes(int(predicted))}; "
                 f"this machine has {format_bytes(int(affordable))} available: not measured")
        return
    if value not in engine_fit.checked and not _checked(engine_fit, measure, value):
        return  # the measuring line said why
    found = largest_measured(measure, engine_fit, scale, limit, affordable, progress, search)
    if found is None:  # the search stopped: the largest value measured under the limit, if any, is what holds
        totals = {v: total for v, total, _ in engine_fit.points} | engine_fit.checked
        ceiling = engine_fit.ceiling
        found = max((v for v, total in totals.items() if total <= limit and (ceiling is None or v < ceiling)),
                    default=None)
    engine_fit.confirmed = found


def hold(engine_fit: EngineFit, measure: Measure, limit: float,
         progress: Progress, search: Search = THOROUGH) -> None:
    """The confirmed answer measured in `search.hold_repeats` processes in all, its largest total kept: the same
    step's resident high-water differs from process to process (by up to 14% on the CPU: glibc's arenas and mmap
    threshold), and an answer must hold in the worse ones. Where one is over the limit, the value steps down by
    `search.resolution` and is measured as often again, `search.hold_steps` times at most. A measurement that fails
    leaves the answer as measured so far (its line said why)."""
    if engine_fit.confirmed is None:
        return
    def proposals() -> Iterator[int]:  # a measurement that fails ends them: the answer stays as measured so far
        value = engine_fit.confirmed
        for _ in range(search.hold_steps):
            for _ in range(search.hold_repeats - (value in engine_fit.checked)):
                yield value
                if engine_fit.checked[value] > limit:
                    break
            if engine_fit.checked[value] <= limit:
                engine_fit.confirmed = value
                return
            value = _step_below(value, engine_fit, search)
        engine_fit.confirmed = None
        engine_fit.unconfirmed = (f"no value held the limit in {search.hold_repeats} processes, down to {value}: its "
                                  "totals differ from process to process by more than the search's steps")
        progress(f"confirming {engine_fit.engine}: {engine_fit.unconfirmed}")

    def probe(value: int) -> bool:
        outcome = measure(value)
        if outcome.measured:
            engine_fit.checked[value] = max(engine_fit.checked.get(value, 0), outcome.total)
        return outcome.measured

    drive(proposals(), probe)


def step_down(engine_fit: EngineFit, measure: Measure, scale: str, limit: float,
              affordable: float, progress: Progress, search: Search = THOROUGH) -> None:
    """An engine's own answer measured once; where it is over the limit, the next value `search.resolution` below,
    until one is under (`search.hold_steps` at most); where it is under by more than `search.timid`, searched up
    (`largest_measured`), so a size model with a wide interval does not leave an answer far short of the limit."""
    def proposals() -> Iterator[int]:
        value = engine_fit.max_fitting
        for _ in range(search.hold_steps):
            if not _known(engine_fit, value):
                yield value
            if engine_fit.total_at(value)[0] <= limit:
                engine_fit.confirmed = value
                return
            if value not in engine_fit.checked:  # over at a point of the grid: no step down from it
                return
            value = _step_below(value, engine_fit, search)

    drive(proposals(), lambda value: _checked(engine_fit, measure, value))
    value = engine_fit.confirmed
    if value is not None and engine_fit.total_at(value)[0] < limit * (1 - search.timid):
        found = largest_measured(measure, engine_fit, scale, limit, affordable, progress, search)
        engine_fit.confirmed = found or value


def check_at(engine_fit: EngineFit, value: int, measure: Measure,
             limit: float) -> bool:
    """One fresh process at `value` where the engine's total there was not yet measured; whether it stays under
    `limit` (an answer that does not is taken back: the caller gives the next one)."""
    if not _known(engine_fit, value) and not _checked(engine_fit, measure, value):
        return False  # the measuring line said why
    return engine_fit.total_at(value)[0] <= limit


def _known(engine_fit: EngineFit, value: int) -> bool:
    """Whether the engine's total at `value` was measured (a point of its grid or toward the answer, or checked)."""
    return value in engine_fit.checked or value in {v for v, _, _ in engine_fit.points}


def _checked(engine_fit: EngineFit, measure: Measure, value: int) -> bool:
    """`measure` at `value`, its total kept in `checked`; False where it has none (the measuring line said why)."""
    outcome = measure(value)
    if outcome.measured:
        engine_fit.checked[value] = outcome.total
    return outcome.measured


def _step_below(value: int, engine_fit: EngineFit, search: Search) -> int:
    """The value `search.resolution` below `value`, a multiple of the engine's step: where hold and step_down go
    next from a value over the limit."""
    return multiple_of(int(value * (1 - search.resolution)), engine_fit.multiple)


def _totals(engine_fit: EngineFit) -> list[tuple[int, int]]:
    return sorted((value, total) for value, total, _ in engine_fit.points)


def largest_measured(measure: Measure, engine_fit: EngineFit, scale: str, limit: float, affordable: float,
                     progress: Progress, search: Search = THOROUGH) -> int | None:
    """The largest value whose measured total stays under `limit`, to within `search.resolution` of it, searched by
    measurement (`search.Toward`: each next value where the line through the two nearest measured totals crosses
    the limit, a halving after each such guess once the answer is bracketed, since two noisy totals can draw a
    line that lands anywhere) from the engine's points and what `checked` holds, one fresh process per value. None
    where a measurement failed, nothing measured is under the limit, the answer is not bracketed and the totals are
    flat, or the next value would not fit this machine (`affordable` bytes)."""
    toward = Toward(lambda: {value: total for value, total, _ in engine_fit.points} | engine_fit.checked, limit,
                    Bracketing(resolution=search.resolution, step=engine_fit.multiple, reach=search.reach_unbracketed),
                    over=lambda: engine_fit.failed, flat=bool(engine_fit.flat))

    def probe(value: int) -> bool:
        if engine_fit.model(value) > affordable:
            progress(f"confirming: {scale}={value} would need more memory than this machine has: search stopped")
            return False
        outcome = measure(value)
        if not outcome.measured:
            progress(f"confirming: {scale}={value}: {outcome.reason}: search stopped")
            return False
        engine_fit.checked[value] = outcome.total
        return True

    drive(toward, probe)
    return toward.answer


def _named(value: int) -> str:
    return "any value" if value >= SEARCH_LIMIT else str(value)
