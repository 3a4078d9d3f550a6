"""What a fit asks, checked before anything is measured: the model file and its form, the parameter values,
the limit and its margin, the engines (each a technique or a combination) and the values of the scale
parameter to measure. A question that cannot be asked as written is a `FitError` saying what is valid."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.errors import Refused
from benchlib.fit.settings import THOROUGH
from benchlib.units import parse_bytes
from benchlib.fit.sizing import MIN_POINTS
from benchlib.usermodel.reading import FileFacts


class FitError(Refused):
    """A fit that cannot be asked as written (an unknown or non-integer parameter, a value too small to
    measure at three points, a size that does not parse): refused before anything is measured."""


class FitInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a fit, carrying what was measured before it (`result`: a `FitResult` or an
    `AtResult`), so the command saves it before it stops."""

    def __init__(self, result: Any, signal_name: str = ""):
        super().__init__()
        self.result, self.signal_name = result, signal_name


@dataclass(frozen=True)
class MemoryLimit:
    """A limit with headroom: `size` ("24 GiB", bytes) of which `margin` (a fraction) is kept free; on the GPU `gpu`
    names (`cuda_policy.GPUS`), whose kernels a prediction emulates as the torch release `torch` chooses them
    (`cuda_policy.TORCH_RULES`; None: the installed one's), and whose memory `size=None` takes."""

    size: Any
    margin: float = 0.0
    gpu: str | None = None
    torch: str | None = None


RUN_ONLY = frozenset({"trials", "precision", "attribute", "module_depth"})  # `run`'s settings, which fit has no use for
DEFAULT_TIMEOUT_S = 600.0  # each process fit starts (a measured step, a trace), as `run_isolated`'s default
TIMEOUT_ENV = "BENCHLIB_FIT_TIMEOUT"  # seconds each of fit's processes may take (`benchlib fit --timeout` sets it)


def process_timeout() -> float:
    """The time each of fit's processes may take: `BENCHLIB_FIT_TIMEOUT` seconds, else `DEFAULT_TIMEOUT_S`."""
    from benchlib.usermodel.reading import env_seconds

    try:
        return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    except ValueError as error:
        raise FitError(str(error)) from None


@dataclass(frozen=True)
class FitFile(FileFacts):
    """The model file as `fit` holds it: the facts a child read (none of the user's code runs in fit's process),
    and the time each of its processes may take (`process_timeout`: `--timeout`)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    world_size: int = 1  # the ranks each engine's step runs on (`-p ranks`): its totals are its worst rank's

    @classmethod
    def of(cls, facts: FileFacts, timeout_s: float = DEFAULT_TIMEOUT_S, world_size: int = 1) -> FitFile:
        return cls(**{field.name: getattr(facts, field.name) for field in dataclasses.fields(facts)},
                   timeout_s=timeout_s, world_size=world_size)


@dataclass(frozen=True)
class Question:
    """A fit's question, checked: the model file (read and form-checked), its form, every parameter's value, the
    limit in bytes, the share of it kept free, and the engines in the registry's spelling."""

    model_file: Any
    form: Any
    values: dict
    limit: int
    margin: float
    engines: list[str]
    added: list[str]  # the combinations added to the engines named (predicted first, measured on the frontier)
    predicted: bool = False  # asked of CUDA on a machine without a GPU: every answer predicted, none measured

    @property
    def usable(self) -> float:
        """What every answer stays under."""
        return self.limit * (1.0 - self.margin)


def ask(path: str | Path, memory: Any, scale: str, engines: Sequence[str] | None,
        params: Mapping[str, Any] | None, predicted: bool = False, asked_by: str = "--scale") -> Question:
    """The `Question` of a fit of the model file at `path` over `scale` under `memory` (a size, or a `MemoryLimit`),
    or FitError. Without `engines`, the form's engines (sweeps left out) and the combinations `-p combinations` adds
    (default: the ones users reach for). The file is read and form-checked in a child (`read_in_child`), as `run`
    reads it; each process fit starts later may take `process_timeout()`. A `predicted` question (CUDA without a
    GPU) starts no process per rank, so the memory free here does not limit its ranks. `asked_by`: the flag that
    named `scale`, as a refusal names it."""
    memory, margin = (memory.size, memory.margin) if isinstance(memory, MemoryLimit) else (memory, 0.0)
    try:
        limit = parse_bytes(memory)
    except ValueError as error:
        raise FitError(f"--memory: {error}") from None
    if limit <= 0:
        raise FitError(f"--memory {memory}: nothing fits in no memory; give the size a step must fit in, as 8GiB or "
                       "'0.5 GB'")
    if not 0.0 <= margin < 1.0:
        raise FitError(f"--margin {margin:g}: a share of the limit kept free, from 0 (none) up to below 1 (e.g. 10%)")
    run_only = sorted(set(params or {}) & RUN_ONLY)
    if run_only:
        raise FitError(f"-p {', '.join(run_only)}: {'is a setting' if len(run_only) == 1 else 'are settings'} of "
                       "`benchlib run`'s trials; fit measures each value in fresh processes of its own (the engines: "
                       "--engines)")
    if engines is not None and not [engine for engine in engines if engine.strip()]:
        raise FitError("--engines names no engine; leave it out for the form's engines, or name some, as torch,torch-sac")
    if engines is not None and not all(engine.strip() for engine in engines):  # as run's -p engines refuses it
        raise FitError(f"--engines {','.join(engines)!r} has an empty name between its commas; name each engine once, "
                       "as torch,torch-sac")
    # the checks above import nothing, so their refusals come at once; reading the file needs the rest
    from benchlib.engines.techniques import CombinationError, added_combinations, technique_registry
    from benchlib.usermodel.case import combination_of
    from benchlib.usermodel.loader import ModelFileError
    from benchlib.usermodel.reading import measure_reading, read_in_child
    from benchlib.usermodel.measuring import TORCH_FORM, spread_over_ranks
    from benchlib.usermodel.named import resolved
    from benchlib.usermodel.parameters import file_benchmark

    (read,) = read_in_child([[str(resolved(path))]], shapes_only=predicted)  # a child reads it, as `run` does
    if isinstance(read, ModelFileError):
        raise read
    (facts,) = read
    if predicted:  # a prediction starts no process per rank: the memory they would hold is not asked for here
        facts = dataclasses.replace(facts, resident_bytes=None)
    if facts.arrays:
        raise FitError(f"{facts.path}: fit takes a model file in the torch form (this one is in the array form)")
    benchmark, form = file_benchmark([facts], False, functools.partial(measure_reading, [str(facts.path)])), TORCH_FORM
    if scale not in facts.parameters:
        raise FitError(f"{asked_by} {scale!r} is not a parameter of {facts.path.name}; its parameters: "
                       f"{', '.join(facts.parameters) or 'none'}")
    by_name = {parameter.name: parameter for parameter in benchmark.parameters}
    typed = {name: by_name[name].parse(value) if isinstance(value, str) and name in by_name else value
             for name, value in (params or {}).items()}  # -p text, as `run` reads it
    values = benchmark.config(typed).plain()  # its rules check ranks and their strategies, as `run` does
    model_file = FitFile.of(facts, process_timeout(), values["ranks"])
    named = list(engines or [engine for engine in values["engines"] if engine not in form.sweep_engines])
    try:  # each a technique or a combination, named in the registry's order as its records will carry it
        chosen = list(dict.fromkeys(combination_of(model_file, engine.strip()).name for engine in named if engine.strip()))
        if model_file.world_size > 1:  # the answer is per rank: every engine under a strategy, none in one process
            chosen = spread_over_ranks(chosen if engines else [form.reference], values["parallel"],
                                       technique_registry(model_file.techniques), form.reference)
    except CombinationError as error:
        raise FitError(f"--engines: {error}") from None
    added = [] if engines or not form.composes or model_file.world_size > 1 else \
        added_combinations(values.get("combinations", "none"), technique_registry(model_file.techniques), chosen)
    return Question(model_file, form, {name: values[name] for name in model_file.parameters}, limit, margin,
                    chosen + added, added, predicted)


def refuse_below_interpreter(question: Question, target) -> None:
    """FitError, before anything is measured, where the limit is below what every process that steps the file holds
    before it builds anything: on the CPU a total is the process's resident memory, and the process that read the
    file held `interpreter_bytes` once it had imported torch."""
    from benchlib.units import format_bytes

    floor = getattr(question.model_file, "interpreter_bytes", None)
    if target.is_cuda or not floor or question.usable >= floor:
        return
    kept = f" less the {question.margin:.0%} kept free" if question.margin else ""
    raise FitError(f"--memory {format_bytes(question.limit)}{kept}: on the CPU a step's total is its process's "
                   f"resident memory, and a process holds {format_bytes(floor)} once it has imported torch, before it "
                   "builds the model (measured in the process that read the file); no value fits under that: give a "
                   "larger limit")


def scale_points(value: Any, scale: str, fractions: tuple[float, ...] = THOROUGH.fractions) -> list[int]:
    """The values of `scale` measured: `fractions` of its given value (`Search.fractions`), distinct, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FitError(f"--scale {scale}: its value is {value!r}; a scale parameter is an integer (a batch size, "
                       "a sequence length)")
    points = sorted({max(1, round(value * fraction)) for fraction in fractions})
    if len(points) < MIN_POINTS:
        raise FitError(f"--scale {scale}={value} gives only {len(points)} distinct values to measure "
                       f"({points}); give a value of 8 or more with -p {scale}=N")
    return points


def parse_at(text: str) -> tuple[str, int]:
    """'batch_size=64' as ('batch_size', 64), or FitError saying what is valid."""
    name, equals, value = (part.strip() for part in text.partition("="))
    if not equals or not name:
        raise FitError(f"--at {text!r}: a parameter and its value, as batch_size=64")
    try:
        number = int(value)
    except ValueError:
        raise FitError(f"--at {text!r}: {value!r} is not an integer; the value of {name} to answer at, as "
                       f"{name}=64") from None
    if number < 1:
        raise FitError(f"--at {text!r}: the value of {name} must be at least 1")
    return name, number
