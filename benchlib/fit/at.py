"""`benchlib fit FILE --memory M --at NAME=VALUE`: the batch a user has, not the largest one. Which engines and
combinations fit that value under the limit, fastest first, each with its total, measured in a fresh process where
this machine can hold the limit, else predicted by `fit`'s size model with its out-of-sample error as the interval.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib.engine_names import REFERENCE
from benchlib.fit import in_child, measured
from benchlib.fit.advice import CheckpointAdvice, EagerStep, advise
from benchlib.fit.asking import FitError, FitInterrupted, MemoryLimit, ask, parse_at, refuse_below_interpreter
from benchlib.fit.largest import fit_asked, gpu_question, on_ranks, total_words
from benchlib.fit.result import MEASURED
from benchlib.fit.settings import THOROUGH, Search
from benchlib.units import format_bytes, format_seconds


@dataclass
class AtEngine:
    """One engine at the value: its total (bytes) and the interval around a prediction, its time per step, or why
    it has none."""

    engine: str
    total: float = math.nan
    low: float = math.nan
    high: float = math.nan
    seconds: float = math.nan
    basis: str = MEASURED  # or "predicted (...)"
    reason: str = ""
    failed: bool = False  # the reason is a failure of its step (raised, killed, timed out), not "does not apply"


@dataclass
class AtResult:
    name: str
    scale: str
    value: int
    limit: int
    margin: float
    device: str
    total: str  # what the totals are, in words
    engines: list[AtEngine] = field(default_factory=list)
    advice: CheckpointAdvice | None = None  # where eager torch does not fit: the blocks to checkpoint, measured

    @property
    def usable(self) -> float:
        return self.limit * (1.0 - self.margin)

    @property
    def failed_engines(self) -> list[str]:
        return [engine.engine for engine in self.engines if engine.failed]

    @property
    def fitting(self) -> list[AtEngine]:
        """The engines whose total (a prediction's upper bound) stays under the limit, fastest first."""
        fits = [engine for engine in self.engines if not engine.reason and
                (engine.high if engine.basis != MEASURED else engine.total) <= self.usable]
        return sorted(fits, key=lambda engine: (math.isnan(engine.seconds), engine.seconds))

    def lines(self) -> list[str]:
        limit = format_bytes(self.limit) + (f" less a {100 * self.margin:g}% margin ({format_bytes(int(self.usable))})"
                                            if self.margin else "")
        fitting, answered = self.fitting, [engine for engine in self.engines if not engine.reason]
        head = f"{self.name} at {self.scale}={self.value}: " + (
            f"{len(fitting)} of {len(self.engines)} engines fit under {limit} ({self.total}), fastest first" if fitting
            else f"no engine fits under {limit} ({self.total})" if answered
            else "no engine could be measured or predicted; each says why")
        width = max((len(engine.engine) for engine in self.engines), default=0)
        others = [engine for engine in self.engines if engine not in fitting]
        lines = [head]
        for engine in [*fitting, *others]:
            if engine.reason:
                lines.append(f"  {engine.engine:<{width}} {engine.reason}")
                continue
            interval = "" if engine.basis == MEASURED else \
                f" [{format_bytes(int(engine.low))}, {format_bytes(int(engine.high))}]"
            time = "" if math.isnan(engine.seconds) else f"  {format_seconds(engine.seconds)}/step"
            verdict = "fits" if engine in fitting else "does not fit"
            lines.append(f"  {engine.engine:<{width}} {verdict}: {format_bytes(int(engine.total))}{interval} "
                         f"{engine.basis}{time}")
        return lines + ([self.advice.line(REFERENCE)] if self.advice is not None else [])

    def records(self) -> list[dict]:
        from benchlib.records import make_record
        from benchlib.records.schema import status_record

        rows = []
        for engine in self.engines:
            labels = dict(benchmark=self.name, case=f"fit {self.scale}={self.value}", engine=engine.engine,
                          device=self.device, dtype="float32")
            common = {"scale": self.scale, "value": self.value, "limit": self.limit, "margin": self.margin,
                      "total": self.total, "basis": engine.basis}
            if engine.reason:
                rows.append(status_record(status="failed" if engine.failed else "not_applicable",
                                          message=engine.reason, params=common, **labels))
                continue
            metric = "fit_total_bytes" if engine.basis == MEASURED else "predicted_total_bytes"
            rows.append(make_record(**labels, metric=metric, value=float(engine.total), unit="B",
                                    params={**common, **({} if engine.basis == MEASURED else
                                                         {"low": engine.low, "high": engine.high})}))
            if not math.isnan(engine.seconds):
                rows.append(make_record(**labels, metric="time", value=engine.seconds, unit="s", params=common))
        return rows


def _advice(model_file, values: dict, device, eager: EagerStep, result: AtResult, progress,
            steps: int) -> CheckpointAdvice:
    """The checkpoint plan (`advice.advise`) for eager's step over the model's blocks; a measured plan joins the
    engines, so its total and time are in the table and the records."""
    try:
        blocks = in_child.blocks(model_file, values)  # the model's structure, read where its code runs
    except in_child.ChildFailed as failed:
        return CheckpointAdvice(reason=str(failed))
    advice = advise(model_file, values, device, eager, result.usable, blocks, progress, steps)
    if advice.engine and not math.isnan(advice.total) and advice.engine not in {e.engine for e in result.engines}:
        result.engines.append(AtEngine(advice.engine, total=advice.total, seconds=advice.seconds))
    return advice


def _measure_each(model_file, values: dict, device, engines: Mapping[str, str | None], result: AtResult,
                  progress: Callable[[str], None], steps: int) -> None:
    """Each engine at the value in a fresh process (`engines`: engine -> why it does not apply, None where it does),
    into `result`; where eager torch is over, the checkpoint plan of its blocks (`_advice`)."""
    scale, value = result.scale, result.value
    eager = None
    for engine, reason in engines.items():
        if reason is not None:
            result.engines.append(AtEngine(engine, reason=f"not applicable: {reason}"))
            continue
        by_module = {"by_module": []} if engine == REFERENCE else {}  # where eager is over: its blocks' bytes
        outcome = measured.measure_step(model_file, engine, values, device, steps=steps, **by_module)  # the one
        if not outcome.measured:
            result.engines.append(AtEngine(engine, reason=outcome.reason, failed=outcome.failed))
        else:
            result.engines.append(AtEngine(engine, total=outcome.total, seconds=outcome.seconds))
            if by_module and outcome.total > result.usable:
                eager = EagerStep(outcome.total, by_module["by_module"])
        progress(f"{model_file.name} {engine} {scale}={value}: "
                 + (outcome.reason or f"{format_bytes(outcome.total)}, {format_seconds(outcome.seconds)}/step"))
    if eager is not None:  # eager does not fit: which of its blocks to checkpoint, measured as an engine
        result.advice = _advice(model_file, values, device, eager, result, progress, steps)


def fit_at(path: str | Path, *, memory: Any, at: str, device: str = "cpu", engines: Sequence[str] | None = None,
           params: Mapping[str, Any] | None = None, progress: Callable[[str], None] = print,
           search: Search = THOROUGH) -> AtResult:
    """Every engine at `at` (NAME=VALUE) under `memory` (a size, or a `MemoryLimit`): measured in a fresh process
    each where this machine can hold the limit (`search.steps` steps each), else predicted by `fit`'s size model over
    the parameter (searched as `search` says), with its out-of-sample error as interval."""
    from benchlib.measure import resolve_device
    from benchlib.measure.devices import cuda_without_gpu
    from benchlib.measure.isolation import available_memory

    scale, value = parse_at(at)
    if scale in (params or {}):
        raise FitError(f"--at {at} and -p {scale}={params[scale]} both set {scale}; give one")
    predicted = cuda_without_gpu(device)  # decided once: the question carries it (`Question.predicted`)
    memory, gpu = gpu_question(memory, predicted, device)
    question = ask(path, memory, scale, engines, {**(params or {}), scale: value}, predicted, asked_by="--at")
    model_file, values, limit, margin, chosen = (question.model_file, question.values, question.limit,
                                                 question.margin, question.engines)
    target = None if predicted else resolve_device(device)
    on_ranks(model_file.world_size, target, predicted)
    if target is not None:
        refuse_below_interpreter(question, target)
    if target is not None and limit <= available_memory(target):
        result = AtResult(model_file.name, scale, value, limit, margin, target.name,
                          total_words(target, model_file.world_size))
        reasons = in_child.engine_facts(model_file, values, target, chosen, model_file.world_size).reasons
        try:
            _measure_each(model_file, values, target, {engine: reasons.get(engine) for engine in chosen}, result,
                          progress, search.steps)
        except KeyboardInterrupt as stopped:  # what was measured goes with it, for the command to save
            raise FitInterrupted(result, getattr(stopped, "signal_name", "")) from None
        return result
    fitted = fit_asked(dataclasses.replace(question, added=[]), scale=scale, device=device,
                       card=gpu if predicted else None, progress=progress, search=search.verifying(False),
                       torch=memory.torch if isinstance(memory, MemoryLimit) else None)
    result = AtResult(fitted.name, scale, value, limit, margin, fitted.device, fitted.total)
    for engine_fit in fitted.engines:
        if engine_fit.model is None:
            result.engines.append(AtEngine(engine_fit.engine, reason=engine_fit.reason))
            continue
        seconds = next((each for at_value, _, each in engine_fit.points if at_value == value), math.nan)
        total, low, high, _ = engine_fit.total_at(value)
        if engine_fit.tolerance and value in engine_fit.traced:
            source, error = "its trace, within", engine_fit.tolerance
        else:
            source, error = "out-of-sample error", max(engine_fit.model.check_error, 0.0)
        result.engines.append(AtEngine(engine_fit.engine, total, low, high, seconds,
                                       f"predicted ({fitted.basis if fitted.predicted else 'size model'}, "
                                       f"{source} {100 * error:.1f}%)"))
    return result
