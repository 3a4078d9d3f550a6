"""Every call of the user's code that `fit` makes beside its measured steps, each in a process of its own
(`benchlib.measure.isolation.call_isolated`), as `run` keeps the same file in children: the engine facts at the asked
values, traces under fake tensors, the CUDA prediction, the model's blocks. A loss that exits, kills its process,
raises or hangs costs that call, which fit reports, never fit's own process and what it has measured.

The functions named `_in_child_*` run in the child (they read the file there); the others are the parent's side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from benchlib.fit.asking import FitError
from benchlib.fit.cuda_policy import DEFAULT_GPU


class ChildFailed(RuntimeError):
    """A call of the user's code failed in its process: raised, exited, was killed or timed out; says which."""


def call_in_child(function: str, model_file, what: str, timeout_s: float | None = None, **params: Any) -> Any:
    """`function(device=, path=model_file.path, **params)` of this module called in a process of its own under
    `timeout_s` (else the file's or the form check's limit), its JSON value back, or ChildFailed saying why: the one
    door of every fit child, which tests of fit's search replace to call the function in their own process."""
    from benchlib.measure import CaseFailed, CaseNotApplicable
    from benchlib.measure.isolation import call_isolated
    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    limit = timeout_s or getattr(model_file, "timeout_s", None) or form_check_timeout()
    try:
        return call_isolated(f"{__name__}:{function}", {"path": str(model_file.path), **params},
                             name=f"{model_file.name} {what}", timeout_s=limit, preload=("torch",))
    except (CaseFailed, CaseNotApplicable) as failed:
        raise ChildFailed(f"{what}: {failed.reason}") from None


def engine_facts(model_file, values: Mapping[str, Any], device, engines: Sequence[str], world_size: int = 1):
    """The form's `EngineFacts` at `values` (which engines do not apply, and why), made in a child under the form check's
    time limit (the model and batch are built there)."""
    from benchlib.usermodel.measuring import EngineFacts
    from benchlib.usermodel.reading import timeout_s as form_check_timeout

    try:
        made = call_in_child("_in_child_engine_facts", model_file, "building the model and batch at the asked values",
                             timeout_s=form_check_timeout(), values=dict(values), target=device.name,
                             engines=list(engines), world_size=world_size)
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


def predicted_engine(model_file, engine: str, values: Mapping[str, Any], scale: str, limit: float,
                     gpu: str = DEFAULT_GPU) -> dict:
    """`predicted.predict_engine` run in a child: the engine's CUDA reserved peaks on the GPU `gpu` names (on
    `model_file.world_size` ranks, rank 0's, simulated there) traced over its grid and search, or {"reason": ...}
    where its step could not be traced."""
    try:
        return call_in_child("_in_child_predicted", model_file, f"predicting {engine}", values=dict(values),
                             engine=engine, scale=scale, limit=float(limit),
                             world_size=getattr(model_file, "world_size", 1), gpu=gpu)
    except ChildFailed as failed:
        return {"reason": f"not predicted: its trace's process failed ({failed})"}


def _in_child_engine_facts(*, device, path: str, values: dict, target: str, engines: list[str], world_size: int = 1) -> dict:
    from benchlib.measure import Device
    from benchlib.usermodel.loader import read_model_file
    from benchlib.usermodel.measuring import TORCH_FORM

    kind, _, index = target.partition(":")  # a CUDA device fit predicts for need not be here: its kind is asked
    made = TORCH_FORM.facts(read_model_file(path), values, Device(kind, int(index) if index else None), engines, {},
                           world_size=world_size)
    return dataclasses.asdict(made)


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


def _in_child_predicted(*, device, path: str, values: dict, engine: str, scale: str, limit: float,
                        world_size: int = 1, gpu: str = DEFAULT_GPU) -> dict:
    from benchlib.fit.predicted import predict_engine
    from benchlib.usermodel.loader import read_model_file

    return predict_engine(read_model_file(path), engine, values, scale, limit, world_size, gpu)
