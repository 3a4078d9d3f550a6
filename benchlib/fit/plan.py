"""A measured fit as one explicit plan: its phases in the order they run (`plan`), each over the engines in play,
and the progress line numbers them ("phase 4/7: toward the answer") beside the processes it counts (`Pace`).

The named engines go through the measuring phases (the grid, farther out, size models, toward the answer); the
combinations a run adds by default are then predicted from their traces, and those that pass every measured
engine (the frontier) go through the measuring phases in turn. Where the answers are confirmed (`Search.verify`),
the largest is searched and held by measurement, every other engine's own answer checked, and the fastest measured
at the value all reach.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from benchlib.fit.asking import Question, scale_points
from benchlib.fit import in_child
from benchlib.fit.measured import (Measure, MeasuredSearch, StepOutcome, check_at, confirm, farther_out, fit_model,
                                   hold, step_down, toward_answer)
from benchlib.fit.result import EngineFit, FitResult
from benchlib.fit.search import SEARCH_LIMIT
from benchlib.fit.sizing import MIN_POINTS, TRACE, TRACE_REACH, SizeModel
from benchlib.units import format_bytes, format_seconds


@dataclass
class MeasuredFit(MeasuredSearch):
    """A measured fit in progress: the search's context, the answer so far, and the engines the measuring phases
    work on now (the named ones, then the frontier of the combinations)."""

    result: FitResult | None = None
    measuring: list[EngineFit] = field(default_factory=list)

    @property
    def in_play(self) -> list[EngineFit]:
        """The engines being measured that may still have an answer (neither the form nor the grid gave a reason)."""
        return [engine_fit for engine_fit in self.measuring if not engine_fit.reason]

    @functools.cached_property
    def affordable(self) -> float:
        """What this machine has available for one confirming process, read once when the confirming begins."""
        from benchlib.measure.isolation import available_memory

        return available_memory(self.device)

    def confirming(self, engine_fit: EngineFit) -> Measure:
        """The engine's step measured to confirm an answer: a process that ends itself once it is past the limit
        (it is over, whatever more it would take) or what this machine has (a prediction that was low cannot start
        a process larger than the machine); a failure takes back any answer at or past it."""
        cap = int(min(self.question.limit * (1 + self.search.cap_slack), self.affordable * 0.9))
        usable = self.usable

        def measure(value: int) -> StepOutcome:
            outcome = self.step(engine_fit, value, cap_bytes=cap)
            if outcome.failed:  # no answer at or past it, whatever was said
                engine_fit.fail(value, outcome.reason, usable)
            self.pace.done(f"confirming {engine_fit.engine} at {self.scale}={value}: " + (outcome.reason or (
                f"{format_bytes(outcome.total)} ({'under' if outcome.total <= usable else 'over'} the limit)")), value)
            return outcome
        return measure


@dataclass(frozen=True)
class Phase:
    """One phase of the plan: its name as the progress line gives it, and what it does; a measuring phase works on
    the engines in play, and is passed over where there are none."""

    name: str
    run: Callable[[MeasuredFit], None]
    measuring: bool = False


def plan(question: Question, verify: bool) -> tuple[Phase, ...]:
    """The phases of a measured fit of `question`, in order: the combinations' only where it adds some, the
    confirming ones only where the answers are confirmed (`verify`)."""
    measuring = [Phase("the grid", grid, True),
                 Phase("farther out, where the totals do not grow", each(farther_out), True),
                 Phase("size models", each(size_model), True),
                 Phase("toward the answer", each(approach_answer), True)]
    phases = list(measuring)
    if question.added:
        phases.append(Phase("the combinations, predicted from their traces", combinations))
        phases += [Phase(f"the frontier, {phase.name}", phase.run, True) for phase in measuring]
    if verify:
        phases += [Phase("confirming the largest", confirm_largest), Phase("each engine's own answer", own_answers),
                   Phase("the fastest, at the value every engine reaches", fastest)]
    return tuple(phases)


def carry_out(phases: tuple[Phase, ...], run: MeasuredFit) -> None:
    """Each phase in turn, announced with its number in the plan before its first line (a phase with nothing to do,
    a frontier with no engine, is passed over in silence)."""
    for number, phase in enumerate(phases, 1):
        if phase.measuring and not run.in_play:
            continue
        run.pace.announce(f"phase {number}/{len(phases)}: {phase.name}")
        phase.run(run)


def each(phase: Callable[[MeasuredSearch, EngineFit], None]) -> Callable[[MeasuredFit], None]:
    """A phase of one engine, run on every engine in play in turn."""
    def over_engines(run: MeasuredFit) -> None:
        for engine_fit in run.in_play:
            phase(run, engine_fit)
    return over_engines


def grid(run: MeasuredFit) -> None:
    """Each engine in play at the grid's values (`Search.fractions` of the value given), one fresh process each;
    an engine refused or failed at `Search.give_up` values before any was measured is not asked again; one with
    fewer than `MIN_POINTS` measured gets a reason, and no answer."""
    scale, values = run.scale, run.question.values
    points = scale_points(values[scale], scale, run.search.fractions)
    applicable = run.in_play
    run.pace.expect(value for value in points for _ in applicable)
    skipped: dict[str, list[tuple[int, str]]] = {engine_fit.engine: [] for engine_fit in applicable}
    for value in points:
        for engine_fit in applicable:
            if not engine_fit.points and len(skipped[engine_fit.engine]) >= run.search.give_up:
                run.pace.drop(value)
                continue
            outcome = run.step(engine_fit, value, planned=True)
            if not outcome.measured:  # maybe at this value only (micro-batches need a multiple of their count)
                skipped[engine_fit.engine].append((value, outcome.reason))
                if outcome.failed:  # the user's code failed there: no answer at or past it
                    engine_fit.failed[value] = outcome.reason
                run.pace.done(f"{run.named(engine_fit, value)}: {outcome.reason}", value)
                continue
            engine_fit.points.append((value, outcome.total, outcome.seconds))
            run.pace.done(f"{run.named(engine_fit, value)}: {format_bytes(outcome.total)}, "
                          f"{format_seconds(outcome.seconds)}/step", value)
    for engine_fit in applicable:
        refusals = skipped[engine_fit.engine]
        if not engine_fit.points:  # refused or failed each time: its last reason, and where
            engine_fit.reason = f"{refusals[-1][1]} (at {scale}={', '.join(str(value) for value, _ in refusals)})"
        elif len(engine_fit.points) < MIN_POINTS:
            engine_fit.reason = (f"{len(engine_fit.points)} of {len(points)} values measured, {MIN_POINTS} needed: "
                                 + "; ".join(f"{scale}={value}: {outcome}" for value, outcome in refusals))


def size_model(run: MeasuredSearch, engine_fit: EngineFit) -> None:
    """The engine's size model over its measured points, or its trace's (`measured.fit_model`)."""
    fit_model(engine_fit, run.model_file, run.question.values, run.scale, run.pace.say)


def approach_answer(run: MeasuredSearch, engine_fit: EngineFit) -> None:
    """Points measured toward the engine's answer (`measured.toward_answer`), then its answer."""
    toward_answer(run, engine_fit)
    engine_fit.max_fitting = engine_fit.answer(run.usable)


def combinations(run: MeasuredFit) -> None:
    """The combinations added predicted from their traces; those past every measured engine's answer are measured
    next (the measuring phases' engines become them)."""
    question = run.question
    named = [engine_fit for engine_fit in run.result.engines if engine_fit.engine not in question.added]
    added = [engine_fit for engine_fit in run.result.engines if engine_fit.engine in question.added]
    points = scale_points(question.values[run.scale], run.scale, run.search.fractions)
    run.measuring = predict_added(added, named, question, run.scale, points, run.pace.say)


def confirm_largest(run: MeasuredFit) -> None:
    """The largest value searched by measurement up to the first value over the limit (`confirm`) and held in
    `search.hold_repeats` processes (`hold`); an engine confirmed below another's prediction hands the answer on, and
    that one is confirmed."""
    tried = set()
    while (best := run.result.best) is not None and best.points and best.engine not in tried:
        tried.add(best.engine)
        confirm(best, run.confirming(best), run.scale, run.usable, run.affordable, run.pace.say, run.search)
        hold(best, run.confirming(best), run.usable, run.pace.say, run.search)


def own_answers(run: MeasuredFit) -> None:
    """Each other measured engine at its own answer, stepping down where it is over (`step_down`: a total can grow
    faster past the points than the model saw)."""
    for engine_fit in sorted(run.result.fitted, key=lambda fit: fit.largest, reverse=True):
        if engine_fit.unconfirmed:  # no value held in every process: one more process cannot say one does
            continue
        if engine_fit.points and engine_fit.confirmed is None and engine_fit.max_fitting < SEARCH_LIMIT:
            step_down(engine_fit, run.confirming(engine_fit), run.scale, run.usable, run.affordable, run.pace.say,
                      run.search)


def fastest(run: MeasuredFit) -> None:
    """The fastest engine measured once at the largest value every measured engine reaches."""
    quickest, common = run.result.fastest, run.result.common_value
    if quickest is not None and common is not None and common < SEARCH_LIMIT:
        check_at(quickest, common, run.confirming(quickest), run.usable)


def predict_added(added: list[EngineFit], named: list[EngineFit], question: Question, scale: str,
                  points: list[int], say: Callable[[str], None]) -> list[EngineFit]:
    """Each added combination's answer predicted from its step traced under fake tensors, on the offset the reference
    engine's traced peaks leave to its measured totals (the interpreter, torch), with that mapping's own
    out-of-sample error; returns those whose prediction passes every measured engine's answer, to be measured."""
    reference = next((fit for fit in named if fit.traced and fit.points and fit.model is not None), None)
    reached = max((fit.max_fitting for fit in named if fit.max_fitting is not None), default=0)
    frontier = []
    for engine_fit in added:
        if engine_fit.reason:
            continue
        if reference is None:
            engine_fit.reason = ("not predicted: no measured engine's step could be traced to map traced bytes to "
                                 "totals; name it with --engines to measure it")
            continue
        model = _offset_model(reference, engine_fit, question, scale, points)
        if model is None:  # nothing says it is on the frontier: measuring every such one would cost the most
            engine_fit.reason = (f"not predicted: its step cannot be traced under fake tensors ({engine_fit.untraced}); "
                                 "name it with --engines to measure it")
            engine_fit.untraced = ""
            continue
        engine_fit.model = model
        engine_fit.max_fitting = model.largest_under(question.usable / (1 + model.check_error), min(points))
        if engine_fit.max_fitting is not None and engine_fit.max_fitting > reached:
            say(f"{question.model_file.name} {engine_fit.engine}: predicted up to {scale}={engine_fit.max_fitting}, "
                f"past every measured engine ({reached}): measured")
            engine_fit.model, engine_fit.max_fitting, engine_fit.traced = None, None, {}
            frontier.append(engine_fit)
        else:
            engine_fit.unmeasured = (f"predicted from its trace (up to {engine_fit.max_fitting or 'none'}), not past "
                                     f"the measured engines' largest ({reached}): not measured")
    return frontier


def _offset_model(reference: EngineFit, engine_fit: EngineFit, question: Question, scale: str,
                  points: list[int]) -> SizeModel | None:
    """The combination's traced peaks over the grid and at `TRACE_REACH` times its largest value, plus the reference
    engine's offset (its median measured total less its traced peak), as a size model whose error is that offset's,
    checked on the reference's largest point; None where the step cannot be traced (`untraced` says why)."""
    import numpy as np

    from benchlib.usermodel.case import combination_of

    model_file, values = question.model_file, question.values
    untraceable = combination_of(model_file, engine_fit.engine).untraceable
    if untraceable is not None:
        engine_fit.untraced = untraceable
        return None
    grid = sorted({*points, *(points[-1] * k for k in TRACE_REACH)})
    engine_fit.traced, untraced = in_child.traced_peaks(model_file, engine_fit.engine, values, scale, grid)
    if untraced is not None:
        engine_fit.untraced, engine_fit.traced = untraced, {}
        return None
    measured = sorted((value, total) for value, total, _ in reference.points if value in reference.traced)
    offsets = [total - reference.traced[value] for value, total in measured]
    offset = float(np.median(offsets[:-1]))
    error = abs(reference.traced[measured[-1][0]] + offset - measured[-1][1]) / measured[-1][1]
    x = np.array(list(engine_fit.traced), float)
    curve = np.polyfit(x, np.array(list(engine_fit.traced.values()), float) + offset, 1)
    return SizeModel(TRACE, tuple(float(c) for c in curve), error)
