"""A user's own model, in one Python file, as a `benchlib.Benchmark` (`benchlib run my_model.py`).

`load_model_file(path)` reads the file (the torch form: see `benchlib.usermodel.loader`), types its
PARAMETERS by their defaults, and, before anything is measured, builds the model and batch at the
QUICK values (small, so cheap) and calls loss once: a loss that returns a non-scalar or a
non-tensor is refused there, not in the middle of a run. The benchmark it returns measures every
engine of `benchlib.usermodel.engines` in fresh processes (`benchlib.usermodel.compare`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from benchlib.benchmark import Benchmark, DeclarationError, Parameter, ParameterError
from benchlib.usermodel.case import ROLE_METRICS
from benchlib.results.plots.usermodel import memory_by_role, peak_intervals
from benchlib.usermodel.compare import measure_model_files
from benchlib.usermodel.engines import ENGINES
from benchlib.usermodel.loader import ModelFile, ModelFileError, check_form, read_model_file
from benchlib.usermodel.summary import summary_table

TRIALS = Parameter("trials", 3, "fresh processes per engine, interleaved across engines", quick=2, minimum=1)
ENGINE_CHOICE = Parameter("engines", tuple(ENGINES), "the engines to measure", choices=ENGINES)
OWN = (TRIALS, ENGINE_CHOICE)  # benchlib's parameters of every model file
HEADLINE = ("peak_bytes", "time", "alloc_count", "alloc_count_python", "gc_time")


def _parameters(model_file: ModelFile) -> tuple[Parameter, ...]:
    parameters = []
    for name, default in model_file.parameters.items():
        if name in {own.name for own in OWN}:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] is benchlib's own ({name}: "
                                 f"{next(own.help for own in OWN if own.name == name)}); give yours another name")
        quick = {"quick": model_file.quick[name]} if name in model_file.quick else {}
        try:
            parameters.append(Parameter(name, default, f"from {model_file.path.name}'s PARAMETERS", **quick))
        except (DeclarationError, ParameterError) as error:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] = {default!r}"
                                 + (f", QUICK {model_file.quick[name]!r}" if quick else "") + f": {error}") from None
    return (*parameters, *OWN)


def version_labels(paths: Sequence[str | Path]) -> list[str]:
    """Each file's version: its stem, or its path where two stems are the same."""
    stems = [Path(path).stem for path in paths]
    return [stem if stems.count(stem) == 1 else str(path) for stem, path in zip(stems, paths)]


def load_model_file(path: str | Path) -> Benchmark:
    """The benchmark a model file declares, its form checked by one loss call at the QUICK values."""
    return load_model_files([path])


def load_model_files(paths: Sequence[str | Path]) -> Benchmark:
    """One benchmark of the files (versions of one NAME, at the same PARAMETERS and QUICK), each file's
    form checked by one loss call at the QUICK values."""
    files = [read_model_file(path) for path in paths]
    model_file = files[0]
    for other in files[1:]:
        if other.name != model_file.name:
            raise ModelFileError(f"{other.path}: NAME {other.name!r} is not {model_file.path.name}'s {model_file.name!r}; "
                                 "versions of one benchmark share a NAME (run different NAMEs as separate arguments)")
        if (other.parameters, other.quick) != (model_file.parameters, model_file.quick):
            raise ModelFileError(f"{other.path}: PARAMETERS or QUICK differ from {model_file.path}'s; versions of one "
                                 "benchmark run at the same values, so their ratio compares the code alone")
    parameters = _parameters(model_file)
    quick = {p.name: p.quick if p.has_quick else p.default for p in parameters if p not in OWN}
    for each in files:
        check_form(each, {name: list(v) if isinstance(v, tuple) else v for name, v in quick.items()})
    versions = dict(zip(version_labels([f.path for f in files]), files))
    names = " and ".join(f.path.name for f in files)
    return Benchmark(
        name=model_file.name,
        question=f"What does one gradient step of {names} cost in memory, allocations and time, "
                 "under each engine?",
        cases="one training step (forward, backward and, when the file declares one, the optimizer's step) per "
              "engine, each in fresh processes, `trials` times interleaved (across versions too): peak, time, both "
              "allocation counts, GC pauses, memory by role and the gradient's error against eager torch",
        parameters=parameters,
        measure=functools.partial(measure_model_files, versions),
        headline=HEADLINE,
        metrics=ROLE_METRICS,
        summarize=summary_table,
        figures={"peak": peak_intervals, "roles": memory_by_role},
    )


__all__ = ["ModelFileError", "load_model_file", "load_model_files", "read_model_file", "version_labels"]
