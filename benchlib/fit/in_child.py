"""Every call of the user's code that `fit` makes beside its measured steps, each in a process of its own
(`benchlib.measure.isolation.call_isolated`), as `run` keeps the same file in children: the engine facts at the asked
values, traces under fake tensors, the CUDA prediction, the model's blocks. A loss that exits, kills its process,
raises or hangs costs that call, which fit reports, never fit's own process and what it has measured.

The functions named `_in_child_*` run in the child (they read the file there); the others are the parent's side.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchlib.errors import Failed
from benchlib.fit.asking import FitError
from benchlib.fit.cuda_policy import DEFAULT_GPU


class ChildFailed(Failed):
    """A call of the user's code failed in its process: raised, exited, was killed or timed out; says which."""


def call_in_child(function: str, model_file, what: str, timeout_s: float | None = None, **params: Any) -> Any:
    """`function(device=, path=model_file.path, **params)` of this module called in a process of its own under
    `timeout_s` (else the file's or the form check's limit), its JSON value back, or ChildFailed saying why: the one
    door of every fit child, which tests of fit's search replace to call the function in their own process."""
    from benchlib.measure import CaseFailed, CaseNotApplicable
    from benchlib.measure.isolation import call_isolated
    from benchlib.usermodel.loader import top_level_imports
    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    limit = timeout_s or getattr(model_file, "timeout_s", None) or form_check_timeout()
    preload = ("torch", *top_level_imports(Path(model_file.path)))  # one template imports the file's packages
    # (transformers: 6 s) for all of fit's children, as a measured step's template does
    try:
        return call_isolated(f"{__name__}:{function}", {"path": str(model_file.path), **params},
                             name=f"{model_file.name} {what}", timeout_s=limit, preload=preload)
    except (CaseFailed, CaseNotApplicable) as failed:
        raise ChildFailed(f"{what}: {failed.reason}") from None


def engine_facts(model_file, values: Mapping[str, Any], device, engines: Sequence[str], world_size: int = 1,
                 shapes_only: bool = False):
    """The form's `EngineFacts` at `values` (which engines do not apply, and why), made in a child under the form check's
    time limit (the model and batch are built there: with `shapes_only`, on the meta device where the file allows)."""
    from benchlib.usermodel.measuring import EngineFacts
    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    try:
        made = call_in_child("_in_child_engine_facts", model_file, "building the model and batch at the asked values",
                             timeout_s=form_check_timeout(), values=dict(values), target=device.name,
                             engines=list(engines), world_size=world_size, shapes_only=shapes_only)
    except ChildFailed as failed:  # the file's code fails at these values: refused before anything is measured
        raise FitError(f"{model_file.path}: {failed}") from None
    return EngineFacts(**made)


def traced_peaks(model_file, engine: str, values: Mapping[str, Any], scale: str, at: Sequence[int]
                 ) -> tuple[dict[int, int], str | None]:
    """The traced peaks (`tracing.traced_peak`) of `engine`'s step at each of `at`, traced in one child, and why the
    trace stopped where it did (None: every value traced)."""
    try:
        made = call_in_child("_in_child_traces", model_file, f"tracing {engine}", values=dict(values), engine=engine,
                             scale=scale, at=[int(value) for value in at])
    except ChildFailed as failed:
        return {}, f"its trace's process failed ({failed})"
    return {int(value): int(peak) for value, peak in made["peaks"].items()}, made["untraced"]


def blocks(model_file, values: Mapping[str, Any]) -> list[str]:
    """The module paths a checkpoint can be put on (`checkpoint_blocks`) of the model built at `values`, in a child."""
    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    return call_in_child("_in_child_blocks", model_file, "building the model at the asked values",
                         timeout_s=form_check_timeout(), values=dict(values))


def batch_bytes(model_file, values: Mapping[str, Any], scale: str, at: int) -> int:
    """Bytes of the batch alone at `scale`=`at` (its tensors' storages), built in a child (at a value whose step was
    measured, so it fits): what a step needs at the least, to scale to larger values."""
    return int(call_in_child("_in_child_batch_bytes", model_file, "building the batch", values=dict(values),
                             scale=scale, at=int(at)))


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def trace_workers(engines: int) -> int:
    """How many engines' traces run at once: every engine, up to twice the cores. An engine's search is a chain
    (each trace decides the next), so with one engine per core the cores that end their chains first go idle (a
    1.1B model's three engines on two cores: one core traced 10 of the 15 values); side by side the chains share
    every core until the last one ends. A trace is one thread's work and measures no time, so traces side by side
    answer as one after another would."""
    return max(1, min(engines, 2 * usable_cores()))


def predicted_engines(model_file, engines: Sequence[str], values: Mapping[str, Any], scale: str, limit: float,
                      target: tuple[str, str | None] = (DEFAULT_GPU, None)) -> dict[str, dict]:
    """`predicted.predict_engine` of every engine, all in one child that reads the file once and traces `trace_workers` engines
    at a time, each in a fork of its own (which imports nothing again), under the time limit of one engine's
    prediction per round of them; a child that fails fails every engine's prediction, saying why."""
    import math

    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    if not engines:
        return {}
    workers = trace_workers(len(engines))
    each_s = getattr(model_file, "timeout_s", None) or form_check_timeout()
    try:
        asked = {"scale": scale, "limit": float(limit), "world_size": getattr(model_file, "world_size", 1),
                 "gpu": target[0], "torch": target[1]}
        return call_in_child("_in_child_predicted_each", model_file, f"predicting {', '.join(engines)}",
                             timeout_s=each_s * math.ceil(len(engines) / min(workers, usable_cores())),
                             values=dict(values),
                             engines=list(engines), asked=asked, workers=workers)
    except ChildFailed as failed:
        return {engine: {"reason": f"not predicted: its trace's process failed ({failed})"} for engine in engines}


def _in_child_engine_facts(*, device, path: str, values: dict, target: str, engines: list[str], world_size: int = 1,
                           shapes_only: bool = False) -> dict:
    from benchlib.measure import Device
    from benchlib.usermodel.loader import read_model_file
    from benchlib.usermodel.measuring import TORCH_FORM

    kind, _, index = target.partition(":")  # a CUDA device fit predicts for need not be here: its kind is asked
    model_file = read_model_file(path)

    def made():
        return dataclasses.asdict(TORCH_FORM.facts(model_file, values, Device(kind, int(index) if index else None),
                                                   engines, {}, world_size=world_size))

    if shapes_only:  # a prediction never holds the model: built on the meta device, in no time and no memory
        import torch

        try:
            with torch.device("meta"):
                return made()
        except Exception:  # noqa: BLE001 - a file whose model reads its own tensors' values: built as it is
            pass
    return made()


def _in_child_traces(*, device, path: str, values: dict, engine: str, scale: str, at: list[int]) -> dict:
    from benchlib.fit.tracing import traced_peak, untraced_reason
    from benchlib.usermodel.loader import read_model_file

    model_file, peaks = read_model_file(path), {}
    for value in at:
        try:
            peaks[str(value)] = traced_peak(model_file, engine, {**values, scale: value})
        except Exception as error:  # noqa: BLE001 - torch's tracer or the file's code under fake tensors: said
            return {"peaks": peaks, "untraced": untraced_reason(error)}
    return {"peaks": peaks, "untraced": None}


def _in_child_blocks(*, device, path: str, values: dict) -> list[str]:
    from benchlib.engines.techniques.modules import checkpoint_blocks
    from benchlib.usermodel.loader import read_model_file

    model, _ = read_model_file(path).build(values)
    return checkpoint_blocks(model)


def _in_child_batch_bytes(*, device, path: str, values: dict, scale: str, at: int) -> int:
    import torch

    from benchlib.usermodel.loader import read_model_file

    made = read_model_file(path).batch(**{**values, scale: at})  # the batch alone: no model is built
    tensors = made if isinstance(made, (tuple, list)) else (made,)
    return sum(tensor.untyped_storage().nbytes() for tensor in tensors if isinstance(tensor, torch.Tensor))


_PREDICTING: tuple = ()  # what `_in_child_predicted_each` traces, for the forks it makes (they inherit it)


def _in_child_predicted_each(*, device, path: str, values: dict, engines: list[str], asked: dict, workers: int = 1
                             ) -> dict:
    """Each engine's `predict_engine` (`asked`: its scale, limit, world_size, gpu and torch release), `workers` forks
    at a time."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    from benchlib.usermodel.loader import read_model_file

    global _PREDICTING
    _PREDICTING = (read_model_file(path), values, asked)  # imported once, here
    if workers == 1 or len(engines) == 1:
        return {engine: _predicted(engine) for engine in engines}
    made = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        futures = {engine: pool.submit(_predicted, engine) for engine in engines}
        for engine, future in futures.items():
            try:
                made[engine] = future.result()
            except BrokenProcessPool:
                made[engine] = {"reason": "not predicted: the process tracing it ended before it answered "
                                          "(killed, or the file's code exited it)"}
    return made


def _predicted(engine: str) -> dict:
    from benchlib.fit.predicted import predict_engine

    model_file, values, asked = _PREDICTING
    return predict_engine(model_file, engine, values, asked["scale"], asked["limit"], asked["world_size"], asked["gpu"],
                          asked["torch"])
