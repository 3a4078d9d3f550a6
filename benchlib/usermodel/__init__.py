"""A user's own model, in one Python file, as a `benchlib.Benchmark` (`benchlib run my_model.py`).

`load_model_file(path)` reads the file in either form (the torch form, `benchlib.usermodel.loader`;
the array form, `benchlib.usermodel.arrays`), types its PARAMETERS by their defaults, and, before
anything is measured, builds its pieces at the QUICK values (small, so cheap) and calls loss once:
a loss that returns a non-scalar is refused there, not in the middle of a run. The benchmark it
returns measures every engine of the form in fresh processes (`benchlib.usermodel.compare`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from benchlib.benchmark import Benchmark, DeclarationError, Parameter, ParameterError
from benchlib.usermodel.case import ROLE_METRICS
from benchlib.usermodel.arrays import ARRAY_FORM_RUN, array_form, check_array_form
from benchlib.usermodel.compare import TORCH_FORM, measure_model_file
from benchlib.usermodel.loader import (ModelFileError, check_form, is_array_form, open_model_file, read_model_file,
                                       torch_form)
from benchlib.usermodel.summary import summary_table

TRIALS = Parameter("trials", 3, "fresh processes per engine, interleaved across engines", quick=2, minimum=1)
HEADLINE = ("peak_bytes", "time", "alloc_count", "alloc_count_python", "gc_time")


def _parameters(model_file) -> tuple[Parameter, ...]:
    parameters = []
    for name, default in model_file.parameters.items():
        if name == TRIALS.name:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] is benchlib's own (fresh processes per "
                                 "engine); give yours another name")
        quick = {"quick": model_file.quick[name]} if name in model_file.quick else {}
        try:
            parameters.append(Parameter(name, default, f"from {model_file.path.name}'s PARAMETERS", **quick))
        except (DeclarationError, ParameterError) as error:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] = {default!r}"
                                 + (f", QUICK {model_file.quick[name]!r}" if quick else "") + f": {error}") from None
    return (*parameters, TRIALS)


def load_model_file(path: str | Path) -> Benchmark:
    """The benchmark a model file declares, its form checked by one loss call at the QUICK values."""
    path, module = open_model_file(path)
    arrays = is_array_form(module)
    model_file = array_form(path, module) if arrays else torch_form(path, module)
    parameters = _parameters(model_file)
    quick = {p.name: p.quick if p.has_quick else p.default for p in parameters if p is not TRIALS}
    (check_array_form if arrays else check_form)(
        model_file, {name: list(v) if isinstance(v, tuple) else v for name, v in quick.items()})
    step = "one gradient of the loss with respect to the params arrays" if arrays else \
        "one training step (forward, backward and, when the file declares one, the optimizer's step)"
    roles = "" if arrays else ", memory by role"
    return Benchmark(
        name=model_file.name,
        question=f"What does one gradient step of {model_file.path.name} cost in memory, allocations and time, "
                 "under each engine?",
        cases=f"{step} per engine, each in fresh processes, `trials` times interleaved: peak, time, both allocation "
              f"counts, GC pauses{roles} and the gradient's error against eager torch",
        parameters=parameters,
        measure=functools.partial(measure_model_file, model_file, ARRAY_FORM_RUN if arrays else TORCH_FORM),
        headline=HEADLINE,
        metrics=ROLE_METRICS,
        summarize=summary_table,
    )


__all__ = ["ModelFileError", "load_model_file", "read_model_file"]
