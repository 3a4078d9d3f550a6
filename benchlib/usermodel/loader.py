"""A user's model file in the torch form, read and checked before anything is measured.

    def model(**params) -> torch.nn.Module
    def batch(**params) -> a tensor or a tuple of tensors
    def loss(model, *batch) -> a 0-dim tensor
    def optimizer(parameters) -> torch.optim.Optimizer     # optional: a step then includes its step
    NAME = "my_model"; PARAMETERS = {"width": 256}; QUICK = {"width": 16}   # optional

The file is imported under a module name of its own (its folder first on sys.path, as `python
file.py` would have it), so two files with the same stem never meet. Every refusal is one
`ModelFileError` naming the file, the function and what the form expects.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED = ("model", "batch", "loss")
FORM = ("model(**params) -> torch.nn.Module, batch(**params) -> tensor or tuple of tensors, "
        "loss(model, *batch) -> 0-dim tensor, and optionally optimizer(parameters) -> torch.optim.Optimizer")
SEED = 0  # every process builds the same initial model and batch: gradients compare across engines


class ModelFileError(ValueError):
    """A model file the torch form refuses; the one message names the file, the function and what is expected."""


@dataclass(frozen=True)
class ModelFile:
    """The torch form's pieces of one file, checked for presence and signatures (nothing run yet)."""

    path: Path
    name: str
    model: Callable
    batch: Callable
    loss: Callable
    optimizer: Callable | None
    parameters: dict[str, Any]
    quick: dict[str, Any]

    def user_error(self, error: BaseException, function: str) -> str:
        """`error`, raised while running `function`, as one line naming the file's own line that raised it."""
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if Path(frame.filename).resolve() == self.path]
        where = f", line {frames[-1].lineno}, in {frames[-1].name}: {(frames[-1].line or '').strip()}" if frames else ""
        return f"{self.path}{where}: {function} raised {type(error).__name__}: {error}"

    def build(self, values: Mapping[str, Any], device: Any = None) -> tuple[Any, tuple]:
        """The model and batch at `values`, seeded, on `device` (a torch.device; None keeps them where made)."""
        import torch

        torch.manual_seed(SEED)
        module = self.model(**values)
        torch.manual_seed(SEED + 1)
        made = self.batch(**values)
        tensors = made if isinstance(made, (tuple, list)) else (made,)
        if device is not None:
            module = module.to(device)
            tensors = tuple(tensor.to(device) for tensor in tensors)
        return module, tuple(tensors)


def _refuse(path: Path, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: {what}")


def _module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    return f"benchlib_model_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def _import(path: Path):
    """The file as a fresh module; a syntax error or an exception at import names the file's line."""
    source = path.read_text(encoding="utf-8", errors="replace")
    try:
        compile(source, str(path), "exec")
    except SyntaxError as error:
        raise _refuse(path, f"is not valid Python: {error.msg} (line {error.lineno})") from error
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's code: its own line is the message
        del sys.modules[name]
        frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path]
        line = f" at line {frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
        raise _refuse(path, f"fails at import{line}: {type(error).__name__}: {error}") from error
    return module


def _signature(path: Path, function: Callable, name: str) -> inspect.Signature:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise _refuse(path, f"{name} has no signature inspect can read ({error})") from None


def _check_signatures(path: Path, module, parameters: Mapping[str, Any]) -> None:
    for name in ("model", "batch"):
        try:
            _signature(path, getattr(module, name), name).bind(**parameters)
        except TypeError as error:
            listed = ", ".join(parameters) or "none declared"
            raise _refuse(path, f"{name} must accept every PARAMETERS name as a keyword argument, {name}(**params) "
                                f"(PARAMETERS: {listed}): {error}") from None
    loss = _signature(path, module.loss, "loss")
    positional = [p for p in loss.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                     p.VAR_POSITIONAL)]
    if not positional:
        raise _refuse(path, f"loss{loss} must accept (model, *batch): the model first, then the batch's tensors")
    optimizer = getattr(module, "optimizer", None)
    if optimizer is not None:
        if not callable(optimizer):
            raise _refuse(path, "optimizer must be a function optimizer(parameters) -> torch.optim.Optimizer")
        try:
            _signature(path, optimizer, "optimizer").bind(object())
        except TypeError as error:
            raise _refuse(path, f"optimizer must accept one argument, optimizer(parameters): {error}") from None


def _dict(path: Path, module, name: str) -> dict[str, Any]:
    value = getattr(module, name, {})
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise _refuse(path, f"{name} must be a dict of parameter name -> value, got {type(value).__name__}")
    return dict(value)


def read_model_file(path: str | Path) -> ModelFile:
    """Import `path` and check the torch form's names, dicts and signatures; nothing of the user's is called."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist" + ("" if path.suffix == ".py" else " (give a .py file)"))
    path = path.resolve()
    if path.suffix != ".py":
        raise _refuse(path, f"is not a Python file (.py); a model file defines {FORM}")
    module = _import(path)
    loss = getattr(module, "loss", None)
    if getattr(module, "model", None) is None and callable(loss) and \
            next(iter(_signature(path, loss, "loss").parameters), None) == "xp":
        raise _refuse(path, "is in the array form (loss(xp, ...) over an array namespace), which is not supported "
                            f"yet; write the torch form: {FORM}")
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise _refuse(path, f"defines no {', '.join(missing)} function; the torch form is {FORM} "
                            f"(`benchlib new {path.name}` writes a commented example elsewhere)")
    parameters, quick = _dict(path, module, "PARAMETERS"), _dict(path, module, "QUICK")
    unknown = sorted(set(quick) - set(parameters))
    if unknown:
        raise _refuse(path, f"QUICK names {', '.join(unknown)}, which PARAMETERS does not declare")
    _check_signatures(path, module, parameters)
    name = getattr(module, "NAME", re.sub(r"\W", "_", path.stem))
    if not isinstance(name, str) or not name.isidentifier():
        raise _refuse(path, f"NAME must be an identifier (letters, digits, _), got {name!r}"
                            + ("" if hasattr(module, "NAME") else "; set NAME, the file's stem is not one"))
    return ModelFile(path, name, module.model, module.batch, loss, getattr(module, "optimizer", None),
                     parameters, quick)


def check_form(model_file: ModelFile, values: Mapping[str, Any]) -> None:
    """Build the model and batch at `values` and call loss (and optimizer) once: what each returns is the form's."""
    import torch

    path = model_file.path
    try:
        module = model_file.model(**values)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "model(**params)")) from error
    if not isinstance(module, torch.nn.Module):
        raise _refuse(path, f"model(**params) must return a torch.nn.Module, got {type(module).__name__}")
    try:
        made = model_file.batch(**values)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "batch(**params)")) from error
    tensors = made if isinstance(made, (tuple, list)) else (made,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise _refuse(path, f"batch(**params) must return a tensor or a tuple of tensors, got {_kind(made)}")
    try:
        inspect.signature(model_file.loss).bind(module, *tensors)
    except TypeError as error:
        raise _refuse(path, f"loss{inspect.signature(model_file.loss)} must accept (model, *batch); batch gives "
                            f"{len(tensors)} tensor(s): {error}") from None
    try:
        value = model_file.loss(module, *tensors)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "loss(model, *batch)")) from error
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else _kind(value)
        raise _refuse(path, f"loss(model, *batch) must return a 0-dim tensor (e.g. .mean() of the per-sample "
                            f"losses), got {got}")
    if not value.requires_grad:
        raise _refuse(path, "loss(model, *batch) returns a tensor that does not depend on the model's parameters "
                            "(requires_grad is False)")
    if model_file.optimizer is not None:
        try:
            made_optimizer = model_file.optimizer(module.parameters())
        except Exception as error:
            raise ModelFileError(model_file.user_error(error, "optimizer(parameters)")) from error
        if not isinstance(made_optimizer, torch.optim.Optimizer):
            raise _refuse(path, f"optimizer(parameters) must return a torch.optim.Optimizer, got {_kind(made_optimizer)}")


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(type(v).__name__ for v in value) or 'nothing'}"
    return type(value).__name__
