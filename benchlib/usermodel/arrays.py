"""The array form of a model file: NumPy arrays and a loss over an array namespace `xp`.

    def params(**params) -> tuple of NumPy arrays          # differentiated, one floating dtype
    def data(**params) -> tuple of NumPy arrays            # inputs, not differentiated
    def loss(xp, *params, *data) -> a scalar
    NAME = "my_model"; PARAMETERS = {"width": 256}; QUICK = {"width": 16}   # optional

The same file runs under benchlib's engines, HIPS autograd, torch and torch.func: each engine hands
the loss its own `xp` (see `benchlib.engines.namespaces.OP_NAMES`). There is no hand-written
gradient: torch's is the reference. The form check calls the loss once over NumPy through a probe
namespace that records which `xp` names it uses, so a name no engine offers is refused before
anything runs, and one only some engines lack makes those engines not applicable, with the reason.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchlib.engines.functional import array_engine, array_not_applicable
from benchlib.engine_names import AUTOGRAD, BENCHLIB_CHECKPOINT, BENCHLIB_DEFERRED, BENCHLIB_INPLACE, TORCH, TORCH_FUNC
from benchlib.usermodel.measuring import EngineFacts, Form
from benchlib.engines.namespaces import OP_NAMES
from benchlib.usermodel.loader import ARRAY_FORM, SEED, ModelFileError, declared, kind, open_model_file, refuse, signature, user_error

ARRAY_ENGINES = (TORCH, TORCH_FUNC, BENCHLIB_INPLACE, BENCHLIB_DEFERRED, BENCHLIB_CHECKPOINT, AUTOGRAD)
DTYPES = ("float32", "float64")  # those with a gradient tolerance


@dataclass(frozen=True)
class ArrayModelFile:
    """The array form's pieces of one file, checked for presence and signatures (nothing run yet)."""

    path: Path
    name: str
    params: Callable
    data: Callable
    loss: Callable
    parameters: dict[str, Any]
    quick: dict[str, Any]

    def user_error(self, error: BaseException, function: str) -> str:
        return user_error(self.path, error, function)

    def build(self, values: Mapping[str, Any]) -> tuple[tuple, tuple]:
        """The params and data at `values`, NumPy's global generator seeded first (every process alike)."""
        np.random.seed(SEED)
        made = self.params(**values)
        np.random.seed(SEED + 1)
        return _arrays(made), _arrays(self.data(**values))


def _arrays(made) -> tuple:
    return made if isinstance(made, (tuple, list)) else (made,)


def array_form(path: Path, module) -> ArrayModelFile:
    """The array form's names, dicts and signatures checked; nothing of the user's is called."""
    missing = [name for name in ("params", "data", "loss") if not callable(getattr(module, name, None))]
    if missing:
        raise refuse(path, f"defines params but no {', '.join(missing)} function; the array form is {ARRAY_FORM}")
    name, parameters, quick = declared(path, module)
    for function in ("params", "data"):
        try:
            signature(path, getattr(module, function), function).bind(**parameters)
        except TypeError as error:
            raise refuse(path, f"{function} must accept every PARAMETERS name as a keyword argument, "
                               f"{function}(**params) (PARAMETERS: {', '.join(parameters) or 'none declared'}): "
                               f"{error}") from None
    first = next(iter(signature(path, module.loss, "loss").parameters.values()), None)
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        raise refuse(path, f"loss{inspect.signature(module.loss)} must accept (xp, *params, *data): the array "
                           "namespace first, then the arrays")
    return ArrayModelFile(path, name, module.params, module.data, module.loss, parameters, quick)


def read_array_file(path: str | Path) -> ArrayModelFile:
    """Import `path` and check the array form's names, dicts and signatures."""
    return array_form(*open_model_file(path))


@functools.lru_cache(maxsize=None)
def engine_namespace(engine: str, device: str = "cpu"):
    """The `xp` `engine` hands the loss on `device` (torch.func: torch's)."""
    return array_engine(engine).namespace(device)


class _UnknownName(AttributeError):
    pass


class _Probe:
    """benchlib's ops (plain NumPy outside a gradient) that remember every name the loss asks for."""

    def __init__(self):
        from benchlib.autodiff import ops

        self.used: set[str] = set()
        self._spaces = (ops, engine_namespace(AUTOGRAD))

    def __getattr__(self, name: str):
        self.used.add(name)
        for space in self._spaces:
            if hasattr(space, name):
                return getattr(space, name)
        raise _UnknownName(name)


def lacking(used: set[str], spaces: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """Per engine, the `xp` names the loss used that its namespace (`spaces[engine]`) does not offer."""
    spaces = spaces or {engine: engine_namespace(engine) for engine in ARRAY_ENGINES}
    return {engine: missing for engine, space in spaces.items()
            if (missing := sorted(name for name in used if not hasattr(space, name)))}


def _checked_arrays(path: Path, made: tuple, function: str, floating: bool) -> None:
    """NumPy arrays only; params (`floating`) at least one, of one dtype with a gradient tolerance; data may be empty."""
    if not made or not all(isinstance(a, np.ndarray) for a in made):
        if made or floating:
            raise refuse(path, f"{function}(**params) must return a tuple of NumPy arrays, got {kind(made)}")
    if floating:
        dtypes = sorted({str(a.dtype) for a in made})
        if len(dtypes) != 1 or dtypes[0] not in DTYPES:
            raise refuse(path, f"params(**params) must return arrays of one dtype, {' or '.join(DTYPES)}; got "
                               f"{', '.join(dtypes)}")


def check_array_form(model_file: ArrayModelFile, values: Mapping[str, Any]) -> None:
    """Build params and data at `values` and call loss once over NumPy: what each returns is the form's,
    and every `xp` name it uses is one some engine offers."""
    path = model_file.path
    try:
        params, data = model_file.build(values)
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "params(**params) or data(**params)")) from error
    _checked_arrays(path, params, "params", floating=True)
    _checked_arrays(path, data, "data", floating=False)
    try:
        inspect.signature(model_file.loss).bind(None, *params, *data)
    except TypeError as error:
        raise refuse(path, f"loss{inspect.signature(model_file.loss)} must accept (xp, *params, *data); they give "
                           f"{len(params)} + {len(data)} array(s): {error}") from None
    probe = _Probe()
    try:
        value = model_file.loss(probe, *params, *data)
    except _UnknownName as error:
        raise refuse(path, f"loss uses xp.{error}, which no engine offers (each offers {', '.join(OP_NAMES)}; "
                           "arrays support + - * / ** @, unary -, indexing, .T and comparisons)") from None
    except Exception as error:
        raise ModelFileError(model_file.user_error(error, "loss(xp, *params, *data) over NumPy")) from error
    if not isinstance(value, (np.ndarray, np.generic)) or np.ndim(value) != 0:
        got = f"an array of shape {np.shape(value)}" if isinstance(value, np.ndarray) else kind(value)
        raise refuse(path, "loss(xp, *params, *data) must return a scalar array (e.g. xp.mean of the per-sample "
                           f"losses; never float() or .item(), which no engine can differentiate), got {got}")


def _array_facts(model_file: ArrayModelFile, values: dict, device, _engines=(), _options=None) -> EngineFacts:
    """Built once at the run's values: the dtype, and why an engine does not apply (its device, its
    namespace lacks a name the loss uses, torch has no torch.func). Every engine is planned; the array
    form has no technique options."""
    params, data = model_file.build(values)
    probe = _Probe()
    model_file.loss(probe, *params, *data)
    reasons = {engine: f"its namespace has no xp.{', xp.'.join(missing)}, which the loss uses"
               for engine, missing in lacking(probe.used).items()}
    for engine in ARRAY_ENGINES:
        reason = array_not_applicable(engine, device)
        if reason is not None:
            reasons.setdefault(engine, reason)
    return EngineFacts(reasons, str(params[0].dtype), {})


ARRAY_FORM_RUN = Form("benchlib.usermodel.array_case:case", ARRAY_ENGINES, TORCH, _array_facts)
