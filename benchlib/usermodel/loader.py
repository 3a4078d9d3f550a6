"""A user's model file, read and checked before anything is measured: the torch form here, and what
both forms share (import, NAME/PARAMETERS/QUICK, refusals, errors naming the user's line); the
array form's own checks are in `benchlib.usermodel.arrays`.

    def model(**params) -> torch.nn.Module
    def batch(**params) -> a tensor or a tuple of tensors
    def loss(model, *batch) -> a 0-dim tensor
    def optimizer(parameters) -> torch.optim.Optimizer     # optional: a step then includes its step
                                                           # (optimizer(parameters, **params) is given them too)
    def step(model, optimizer, *batch) -> None             # optional: the whole training step, as written
    NAME = "my_model"; PARAMETERS = {"width": 256}; QUICK = {"width": 16}   # optional

The file is imported under a module name of its own (its folder first on sys.path, as `python
file.py` would have it), so two files with the same stem never meet. Every refusal is one
`ModelFileError` naming the file, the function and what the form expects.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from benchlib.errors import Failed, Refused

REQUIRED = ("model", "batch", "loss")
FORM = ("model(**params) -> torch.nn.Module, batch(**params) -> tensor or tuple of tensors, "
        "loss(model, *batch) -> 0-dim tensor, and optionally optimizer(parameters[, **params]) -> torch.optim.Optimizer and "
        "step(model, optimizer, *batch), the whole training step")
ARRAY_FORM = ("params(**params) -> tuple of NumPy arrays (differentiated), data(**params) -> tuple of NumPy "
              "arrays, loss(xp, *params, *data) -> scalar")
SEED = 0  # every process builds the same initial model and batch: gradients compare across engines
RANK_SEED_STRIDE = 1000  # rank r's batch is drawn from SEED + 1 + r * RANK_SEED_STRIDE, apart from every other seed


class ModelFileError(Refused):
    """A model file its form refuses; the one message names the file, the function and what is expected."""


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
    step: Callable | None = None  # the file's own training step (backward, clipping, schedulers...), if any
    techniques: Mapping[str, type] = field(default_factory=dict)  # TECHNIQUES: the file's own step techniques

    def user_error(self, error: BaseException, function: str) -> str:
        return user_error(self.path, error, function)

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    def optimizer_at(self, values: Mapping[str, Any]) -> Callable | None:
        """optimizer(parameters), given `values` too where the file's takes them (optimizer(parameters, **params):
        an optimizer or learning rate chosen by a parameter)."""
        if self.optimizer is None or not takes_values(self.optimizer, values):
            return self.optimizer
        return functools.partial(self.optimizer, **values)

    def build(self, values: Mapping[str, Any], device: Any = None) -> tuple[Any, tuple]:
        """The model and batch at `values`, seeded, on `device` (a torch.device; None keeps them where made)."""
        module = self.seeded_model(values)
        return (module if device is None else module.to(device)), self.seeded_batch(values, device)

    def seeded_model(self, values: Mapping[str, Any]) -> Any:
        """The model at `values` from the seed every process builds it with, where torch makes it."""
        import torch

        torch.manual_seed(SEED)
        return self.model(**values)

    def seeded_batch(self, values: Mapping[str, Any], device: Any = None, rank: int = 0) -> tuple:
        """The batch at `values` on `device`: rank r of a data-parallel step draws its own (rank 0 the one every
        single-process step draws)."""
        import torch

        torch.manual_seed(SEED + 1 + RANK_SEED_STRIDE * rank)
        made = self.batch(**values)
        tensors = made if isinstance(made, (tuple, list)) else (made,)
        return tuple(tensors if device is None else (tensor.to(device) for tensor in tensors))


class UserCodeError(Failed):
    """An exception in the model file's own code during a case; the message names the file's line."""


def user_error(path: Path, error: BaseException, function: str) -> str:
    """`error`, raised while running `function`, as one line naming the file's own line that raised it."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename).resolve() == path]
    where = f", line {frames[-1].lineno}, in {frames[-1].name}: {(frames[-1].line or '').strip()}" if frames else ""
    return f"{path}{where}: {function} raised {type(error).__name__}: {error}"


def guarded(model_file, what: str, fn, *args):
    """`fn(*args)`; an exception in it becomes a UserCodeError naming the file's line that raised it (but
    `NotApplicable`: an engine that cannot run the code, which the run records as not applicable)."""
    from benchlib.measure.case_child import NotApplicable

    try:
        return fn(*args)
    except NotApplicable:  # the engine cannot run this code: not the file's error
        raise
    except Exception as error:
        raise UserCodeError(model_file.user_error(error, what)) from error


def refuse(path: Path, what: str) -> ModelFileError:
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
        raise refuse(path, f"is not valid Python: {error.msg} (line {error.lineno})") from error
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
        raise refuse(path, f"fails at import{line}: {type(error).__name__}: {error}") from error
    return module


def signature(path: Path, function: Callable, name: str) -> inspect.Signature:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise refuse(path, f"{name} has no signature inspect can read ({error})") from None


def _check_signatures(path: Path, module, parameters: Mapping[str, Any]) -> None:
    for name in ("model", "batch"):
        try:
            signature(path, getattr(module, name), name).bind(**parameters)
        except TypeError as error:
            listed = ", ".join(parameters) or "none declared"
            raise refuse(path, f"{name} must accept every PARAMETERS name as a keyword argument, {name}(**params) "
                                f"(PARAMETERS: {listed}): {error}") from None
    loss = signature(path, module.loss, "loss")
    positional = [p for p in loss.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                     p.VAR_POSITIONAL)]
    if not positional:
        raise refuse(path, f"loss{loss} must accept (model, *batch): the model first, then the batch's tensors")
    optimizer = getattr(module, "optimizer", None)
    if optimizer is not None:
        if not callable(optimizer):
            raise refuse(path, "optimizer must be a function optimizer(parameters) -> torch.optim.Optimizer")
        try:
            signature(path, optimizer, "optimizer").bind(object())
        except TypeError as error:
            if not takes_values(optimizer, parameters):
                raise refuse(path, f"optimizer must accept the parameters to optimize, optimizer(parameters), or them "
                                   f"and every PARAMETERS name as a keyword argument, optimizer(parameters, **params): "
                                   f"{error}") from None
    step = getattr(module, "step", None)
    if step is not None:
        if not callable(step):
            raise refuse(path, "step must be a function step(model, optimizer, *batch): the whole training step")
        taken = [p for p in signature(path, step, "step").parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if len(taken) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in taken):
            raise refuse(path, f"step{signature(path, step, 'step')} must accept (model, optimizer, *batch): the "
                               "model, the optimizer (None without one), then the batch's tensors")


def takes_values(optimizer: Callable, values: Mapping[str, Any]) -> bool:
    """Whether optimizer(parameters, **values) binds: the file's optimizer reads its parameters' values."""
    try:
        inspect.signature(optimizer).bind(object(), **values)
    except (TypeError, ValueError):
        return False
    return bool(values)


def _dict(path: Path, module, name: str) -> dict[str, Any]:
    value = getattr(module, name, {})
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise refuse(path, f"{name} must be a dict of parameter name -> value, got {type(value).__name__}")
    return dict(value)


def open_model_file(path: str | Path) -> tuple[Path, Any]:
    """The file's resolved path and its module, freshly imported; nothing of the user's is called yet."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist" + ("" if path.suffix == ".py" else " (give a .py file)"))
    path = path.resolve()
    if path.suffix != ".py":
        raise refuse(path, f"is not a Python file (.py); a model file defines {FORM}, or is in the array form "
                            f"({ARRAY_FORM})")
    return path, _import(path)


def declared(path: Path, module) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """NAME, PARAMETERS and QUICK, as both forms declare them."""
    parameters, quick = _dict(path, module, "PARAMETERS"), _dict(path, module, "QUICK")
    unknown = sorted(set(quick) - set(parameters))
    if unknown:
        raise refuse(path, f"QUICK names {', '.join(unknown)}, which PARAMETERS does not declare")
    name = getattr(module, "NAME", re.sub(r"[^0-9A-Za-z_]", "_", path.stem))
    if not isinstance(name, str) or not (name.isascii() and name.isidentifier()):
        raise refuse(path, f"NAME must be an ASCII identifier (letters a-z, A-Z, digits, _; not a digit first: it names "
                           f"files, records and report sections), got {name!r}"
                            + ("" if hasattr(module, "NAME") else "; set NAME, the file's stem is not one"))
    return name, parameters, quick


def is_array_form(module) -> bool:
    """The array form defines params(**p); the torch form never does."""
    return callable(getattr(module, "params", None))


def torch_form(path: Path, module) -> ModelFile:
    """The torch form's names, dicts and signatures checked; nothing of the user's is called."""
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    loss = getattr(module, "loss", None)
    if "model" in missing and callable(loss) and next(iter(signature(path, loss, "loss").parameters), None) == "xp":
        raise refuse(path, f"loss(xp, ...) is the array form's, which also needs params and data functions: "
                           f"{ARRAY_FORM}")
    if missing:
        raise refuse(path, f"defines no {', '.join(missing)} function; the torch form is {FORM}, the array form "
                            f"{ARRAY_FORM} (`benchlib new {path.name}` writes a commented example elsewhere)")
    name, parameters, quick = declared(path, module)
    _check_signatures(path, module, parameters)
    return ModelFile(path, name, module.model, module.batch, module.loss, getattr(module, "optimizer", None),
                     parameters, quick, getattr(module, "step", None), _techniques(path, module))


def _techniques(path: Path, module) -> dict[str, type]:
    """TECHNIQUES = {"name": TechniqueClass}: the file's own techniques, checked as the registry checks them."""
    from benchlib.engines.techniques import CombinationError, technique_registry

    own = getattr(module, "TECHNIQUES", {})
    if not isinstance(own, Mapping):
        raise refuse(path, f"TECHNIQUES must be a dict of name -> Technique subclass, got {type(own).__name__}")
    try:
        registry = technique_registry(own, f"{path}: TECHNIQUES")
    except CombinationError as error:
        raise ModelFileError(str(error)) from None
    return {name: registry[name] for name in own}


PRELOADED_ANYWAY = ("torch", "benchlib")  # a torch-form case's template imports them whatever the file imports


def top_level_imports(path: Path) -> tuple[str, ...]:
    """The installed packages `path` imports at its top level, found without running it (its own folder's
    modules and anything not installed left out): what a fork template can import once for every trial."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ()
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    found = []
    for name in dict.fromkeys(names):
        if name in sys.builtin_module_names or name in PRELOADED_ANYWAY:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
        if origin and "site-packages" in Path(origin).parts and Path(origin).parent != path.parent:
            found.append(name)
    return tuple(found)


def read_model_file(path: str | Path) -> ModelFile:
    """Import `path` and check the torch form's names, dicts and signatures; nothing of the user's is called."""
    return torch_form(*open_model_file(path))


def check_form(model_file: ModelFile, values: Mapping[str, Any], shapes_only: bool = False) -> None:
    """Build the model and batch at `values` and call loss (and optimizer, and step) once: what each returns is the
    form's. With `shapes_only` (a prediction, for a model perhaps larger than this machine's memory), first from
    shapes alone (`usermodel.shapes`); a file whose step fake tensors cannot run is checked with its real tensors."""
    if shapes_only:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from benchlib.usermodel.shapes import materialized

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                _check_form(model_file, values, materialized)
            return
        except Exception:  # noqa: BLE001 - a step that reads values (.item()): its error, if any, comes from below
            pass
    _check_form(model_file, values)


def _check_form(model_file: ModelFile, values: Mapping[str, Any], build: Callable = lambda make: make()) -> None:
    import torch

    path = model_file.path
    try:
        module = build(lambda: model_file.model(**values))
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "model(**params)")) from error
    if not isinstance(module, torch.nn.Module):
        raise refuse(path, f"model(**params) must return a torch.nn.Module, got {type(module).__name__}")
    if not any(parameter.requires_grad for parameter in module.parameters()):
        raise refuse(path, f"model(**params) returns a {type(module).__name__} with no parameter that requires grad: "
                            "a training step's gradient is taken with respect to the model's parameters, so there "
                            "is nothing to differentiate (give it at least one nn.Parameter)")
    try:
        made = model_file.batch(**values)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "batch(**params)")) from error
    tensors = made if isinstance(made, (tuple, list)) else (made,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise refuse(path, f"batch(**params) must return a tensor or a tuple of tensors, got {kind(made)}")
    try:
        inspect.signature(model_file.loss).bind(module, *tensors)
    except TypeError as error:
        raise refuse(path, f"loss{inspect.signature(model_file.loss)} must accept (model, *batch); batch gives "
                            f"{len(tensors)} tensor(s): {error}") from None
    try:
        value = model_file.loss(module, *tensors)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "loss(model, *batch)")) from error
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else kind(value)
        raise refuse(path, f"loss(model, *batch) must return a 0-dim tensor (e.g. .mean() of the per-sample "
                            f"losses), got {got}")
    if not value.requires_grad:
        raise refuse(path, "loss(model, *batch) returns a tensor that does not depend on the model's parameters "
                            "(requires_grad is False)")
    if model_file.optimizer is not None:
        try:
            made_optimizer = model_file.optimizer_at(values)(module.parameters())
        except Exception as error:
            raise ModelFileError(model_file.user_error(error, "optimizer(parameters)")) from error
        if not isinstance(made_optimizer, torch.optim.Optimizer):
            raise refuse(path, f"optimizer(parameters) must return a torch.optim.Optimizer, got {kind(made_optimizer)}")
    if model_file.step is not None:
        try:
            model_file.step(module, made_optimizer if model_file.optimizer is not None else None, *tensors)
        except Exception as error:
            raise ModelFileError(model_file.user_error(error, "step(model, optimizer, *batch)")) from error


def kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(type(v).__name__ for v in value) or 'nothing'}"
    return type(value).__name__
