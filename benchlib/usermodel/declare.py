"""A model file (or versions of one NAME) as a `benchlib.Benchmark`: read in its form, its PARAMETERS typed
by their defaults (`parameters`), checked by one loss call at the QUICK values, declared with the summary and figures
a run shows (`declaration`), measured by `measuring.measure_model_files`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchlib.benchmark import Benchmark
from benchlib.usermodel.case import CASE_METRICS
from benchlib.report.plots.usermodel import frontier, memory_by_role, peak_intervals
from benchlib.usermodel.arrays import ARRAY_FORM_RUN, ArrayModelFile, array_form, check_array_form
from benchlib.usermodel.measuring import TORCH_FORM, Form, measure_model_files
from benchlib.usermodel.parameters import file_benchmark, file_parameters
from benchlib.records.environment import file_digest
from benchlib.usermodel.loader import (ModelFileError, check_form, is_array_form, open_model_file, torch_form)
from benchlib.usermodel.summary import summary_table

HEADLINE = ("peak_bytes", "tracked_peak_bytes", "time", "alloc_count", "alloc_count_python", "gc_time")


def version_labels(paths: Sequence[str | Path]) -> list[str]:
    """Each file's version: its stem, or its path where two stems are the same."""
    stems = [Path(path).stem for path in paths]
    return [stem if stems.count(stem) == 1 else str(path) for stem, path in zip(stems, paths)]


def load_model_file(path: str | Path) -> Benchmark:
    """The benchmark a model file declares, its form checked by one loss call at the QUICK values."""
    return load_model_files([path])


def _read(path: str | Path):
    """The file, read in its form: the array form's pieces where it declares them, else the torch form's."""
    path, module = open_model_file(path)
    return array_form(path, module) if is_array_form(module) else torch_form(path, module)


def _form_name(model_file) -> str:
    return "array form" if isinstance(model_file, ArrayModelFile) else "torch form"


def load_model_files(paths: Sequence[str | Path], checked: Mapping[str, str] | None = None) -> Benchmark:
    """One benchmark of the files (versions of one NAME, of one form, at the same PARAMETERS and QUICK),
    each file's form checked by one loss call at the QUICK values (not again where `checked` holds its digest)."""
    return declare_model_files(paths, checked=checked)[0]


def declare_model_files(paths: Sequence[str | Path], shapes_only: bool = False,
                        checked: Mapping[str, str] | None = None) -> tuple[Benchmark, list, Form]:
    """`load_model_files`' benchmark, with the files read and their form (for one engine's step alone); with
    `shapes_only`, the torch form checked from shapes alone where the step allows (`check_form`). `checked` maps
    a resolved path to the digest (`file_digest`) of the content a form check already passed (the runner's reading
    child, moments before this kernel): a file still of that content is not checked again (the check's loss and
    optimizer calls import torch's dynamo stack, seconds a run)."""
    passed = {str(Path(path).expanduser().resolve()) for path in paths
              if checked and checked.get(str(Path(path).expanduser().resolve())) == file_digest(path)}
    files = [_read(path) for path in paths]
    model_file = files[0]
    for other in files[1:]:
        if other.name != model_file.name:
            raise ModelFileError(f"{other.path}: NAME {other.name!r} is not {model_file.path.name}'s {model_file.name!r}; "
                                 "versions of one benchmark share a NAME (run different NAMEs as separate arguments)")
        if _form_name(other) != _form_name(model_file):
            raise ModelFileError(f"{other.path}: it is of the {_form_name(other)}, {model_file.path.name} of the "
                                 f"{_form_name(model_file)}; versions of one benchmark are of one form, so their "
                                 "engines are the same")
        if (other.parameters, other.quick) != (model_file.parameters, model_file.quick):
            raise ModelFileError(f"{other.path}: PARAMETERS or QUICK differ from {model_file.path}'s; versions of one "
                                 "benchmark run at the same values, so their ratio compares the code alone")
    arrays = isinstance(model_file, ArrayModelFile)
    form = ARRAY_FORM_RUN if arrays else TORCH_FORM
    parameters = file_parameters(model_file, form)
    quick = {p.name: p.quick if p.has_quick else p.default for p in parameters[:len(model_file.parameters)]}
    for each in files:
        if str(Path(each.path).resolve()) in passed:
            continue
        values = {name: list(v) if isinstance(v, tuple) else v for name, v in quick.items()}
        check_array_form(each, values) if arrays else check_form(each, values, shapes_only)
    versions = dict(zip(version_labels([f.path for f in files]), files))
    return declaration(files, arrays, functools.partial(measure_model_files, versions, form)), files, form


def declaration(files: Sequence, arrays: bool, measure) -> Benchmark:
    """The benchmark of model files already read and checked (`parameters.file_benchmark`), with what a run of it
    shows: its headline metrics, summary table and figures."""
    return dataclasses.replace(
        file_benchmark(files, arrays, measure),
        headline=HEADLINE,
        metrics=CASE_METRICS,
        summarize=summary_table,
        figures={"frontier": frontier, "peak": peak_intervals, **({} if arrays else {"roles": memory_by_role})},
    )
