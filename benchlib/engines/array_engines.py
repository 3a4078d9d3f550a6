"""The gradient engines under comparison, behind one small interface.

An engine turns a loss written against an array namespace `xp` (see `Engine.namespace`) into a
gradient function with `benchlib.autodiff.grad`'s calling convention: `argnum` an int gives one
gradient, a tuple gives a tuple. `manual` is the hand-written backward pass each workload supplies
(`Engine.gradient(..., manual=...)`); it is the reference the others are checked against.
Adding an engine means adding its name to `benchlib.engine_names` (each name is written only
there) and one entry to `ENGINES`. The package re-exports this module's public names.

    engine = get_engine(TORCH)
    reason = engine.not_applicable(device, dtype)   # e.g. HIPS autograd on CUDA: record it, don't drop it
    xp = engine.namespace(device)
    x = engine.asarray(x_numpy, device)          # NumPy, or a torch tensor on the device
    gradient = engine.gradient(make_loss(xp), argnum=0, manual=hand_written)
    set_up = engine.prepare(lambda: gradient(x, z), device)   # torch.compile compiles here: {"compile_time": s}
    engine.to_numpy(gradient(x, z))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from benchlib.engine_names import (AUTOGRAD, BENCHLIB_CHECKPOINT, BENCHLIB_DEFERRED, BENCHLIB_INPLACE, MANUAL, MANUAL_SEED,
                                   TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_COMPILE, TORCH_SAC)
from benchlib.engines import namespaces
from benchlib.errors import Refused

# torch.utils.checkpoint and the compiler import the dynamo stack on first use (0.9 s a trial on a 2-core machine):
# an engine that does names it in `Engine.imports`, and a fork template preloads it (`forkserver.LAZY_IMPORTS`)
DYNAMO = "torch._dynamo"
AUTOCAST_DTYPE = "bfloat16"  # torch-autocast's, on CPU and CUDA alike (float16 would need a gradient scaler)
LOWERED_FROM = "float32"  # the data autocast lowers: float64 operations stay float64



class NotApplicableError(RuntimeError):
    """Raised when an engine is asked to run where it cannot: a device it does not support, or a
    workload that has no hand-written gradient of its kind."""


def _device(device):
    """Accept a `benchlib.measure.Device` or a device spec string ("cpu", "cuda:0", "auto")."""
    if hasattr(device, "kind"):
        return device
    from benchlib.measure import resolve_device

    return resolve_device(device)


def _valid_argnum(argnum) -> bool:
    if isinstance(argnum, tuple):
        return bool(argnum) and all(isinstance(i, int) for i in argnum)
    return isinstance(argnum, int)


def _argnums(argnum) -> tuple[int, ...]:
    return (argnum,) if isinstance(argnum, int) else tuple(argnum)


def _benchlib_gradient(accumulate: str, checkpoint=None):
    def make(fun, argnum):
        from benchlib import autodiff

        return autodiff.grad(fun, argnum, accumulate=accumulate, checkpoint=checkpoint)

    return make


def _benchlib_namespace(device):
    from benchlib.autodiff import ops

    return ops


def _autograd_gradient(fun, argnum):
    import autograd

    return autograd.grad(fun, argnum)


def _torch_gradient(fun, argnum, autocast_to: str | None = None):
    """torch.autograd.grad on fresh leaves that share the inputs' storage (no copies); `autocast_to`: the loss
    evaluated under autocast to that dtype (torch's recipe: the forward in the context, the backward outside it,
    where each op's backward runs in its forward's dtype)."""
    import torch

    argnums = _argnums(argnum)

    def gradient(*args):
        args = list(args)
        for index in argnums:
            args[index] = args[index].detach().requires_grad_(True)
        leaves = [args[index] for index in argnums]
        if autocast_to is None:  # eager torch's call exactly as it was: nothing more in its measured calls
            grads = torch.autograd.grad(fun(*args), leaves)
        else:
            where = next((arg.device.type for arg in args if isinstance(arg, torch.Tensor)), "cpu")
            with torch.autocast(where, dtype=getattr(torch, autocast_to)):
                loss = fun(*args)
            grads = torch.autograd.grad(loss, leaves)
            del loss
        return grads[0] if isinstance(argnum, int) else tuple(grads)

    return gradient


def _autocast_torch_gradient(fun, argnum):
    return _torch_gradient(fun, argnum, autocast_to=AUTOCAST_DTYPE)


def _compiled_torch_gradient(fun, argnum):
    """torch.autograd.grad through `torch.compile(fun)`: the compiled forward and its backward are one node of
    autograd's graph. Compiling happens on the first call (`Engine.prepare` makes it in the set-up)."""
    from benchlib.engines.compiling import compiled, run_marks_eagerly

    run_marks_eagerly()
    return _torch_gradient(compiled(fun), argnum)


def _cpu_only(engine_name: str):
    def not_applicable(device):
        if device.kind != "cpu":
            return f"{engine_name} computes with NumPy, on the CPU only (asked for {device.name})"
        return None

    return not_applicable


def _everywhere(device):
    return None


@dataclass(frozen=True)
class Engine:
    """One gradient engine: how it differentiates, which arrays it takes, where it runs.

    `cpu_library` is the array library the engine computes with on the CPU ("numpy" or "torch");
    on CUDA every engine that runs there computes with torch tensors on the device.
    """

    name: str
    description: str
    cpu_library: str
    _make_gradient: Callable[[Callable, Any], Callable] | None
    _namespace: Callable[[Any], Any]
    _not_applicable: Callable[[Any], str | None] = _everywhere
    compiles: bool = False  # its first call compiles: `prepare` makes it in the set-up
    lowers_to: str | None = None  # the dtype its forward computes in (autocast), from float32 data only
    imports: tuple[str, ...] = ()  # what its set-up or first call imports beyond its array library
    keeps_contributions: bool = False  # every gradient contribution is held until the end (memory estimates)

    @property
    def seed_written(self) -> bool:
        """True for `manual-seed`: the seed's own code, which only some of a workload's models have."""
        return self.name == MANUAL_SEED

    @property
    def hand_written(self) -> bool:
        """True for `manual` and `manual-seed`: the gradient is a backward pass the workload wrote."""
        return self._make_gradient is None

    def not_applicable(self, device, dtype: str | None = None) -> str | None:
        """Why this engine cannot run on `device` (with data of `dtype`, when given), or None when it can."""
        reason = self._not_applicable(_device(device))
        if reason is None and self.lowers_to is not None and dtype not in (None, LOWERED_FROM):
            reason = (f"autocast lowers {LOWERED_FROM} operations to {self.lowers_to} and leaves {dtype} ones as "
                      f"they are: this would be torch's step again (dtype={LOWERED_FROM} lets it apply)")
        return reason

    def computes_in(self, dtype: str) -> str:
        """The dtype this engine's gradient is computed in from `dtype` data: what its records carry, and whose
        tolerance judges its gradient."""
        return self.lowers_to if self.lowers_to is not None and dtype == LOWERED_FROM else dtype

    def prepare(self, call: Callable[[], Any], device) -> dict[str, float]:
        """What the engine does before its calls are measured, with `call` one call of its gradient: a
        compiling engine compiles (its first call, timed apart: {`COMPILE_METRIC`: seconds}); others nothing."""
        if not self.compiles:
            return {}
        from benchlib.engines.compiling import compile_first_call
        from benchlib.records.metrics import COMPILE_METRIC

        return {COMPILE_METRIC: compile_first_call(call, _device(device))}

    def _require(self, device):
        device = _device(device)
        reason = self._not_applicable(device)
        if reason is not None:
            raise NotApplicableError(reason)
        return device

    def array_library(self, device) -> str:
        """"numpy" or "torch": what `asarray` returns on `device`."""
        device = self._require(device)
        return self.cpu_library if device.kind == "cpu" else "torch"

    def namespace(self, device):
        """The `xp` a loss (or, for `manual`, the hand-written backward pass) is written against."""
        return self._namespace(self._require(device))

    def asarray(self, array: np.ndarray, device):
        """`array` in this engine's library on `device`, same shape (0-d stays 0-d); no copy of a
        C-contiguous array on the CPU."""
        array = np.asarray(array)
        if self.array_library(device) == "numpy":
            return array
        import torch

        # ascontiguousarray returns at least 1-d: reshape restores a 0-d array's shape (a view).
        return torch.from_numpy(np.ascontiguousarray(array).reshape(array.shape)).to(_device(device).torch)

    @staticmethod
    def to_numpy(array) -> np.ndarray:
        """Any engine's array as NumPy: CUDA tensors are copied to the host, CPU arrays and
        tensors are shared, not copied."""
        if hasattr(array, "detach"):
            return array.detach().cpu().numpy()
        return np.asarray(array)

    def gradient(self, fun: Callable, argnum=0, *, manual: Callable | Mapping[str, Callable] | None = None) -> Callable:
        """The gradient function of `fun` with respect to `argnum` (an int or a tuple of ints).

        `manual` is the workload's hand-written gradient (same arguments, same return convention),
        or a mapping from hand-written engine name (`manual`, `manual-seed`) to one; the
        hand-written engines return theirs, every other engine ignores it.
        """
        if not _valid_argnum(argnum):
            raise ValueError(f"argnum must be an int or a non-empty tuple of ints, got {argnum!r}")
        if self.hand_written:
            if manual is None:
                raise ValueError(f"engine {self.name!r} needs the workload's hand-written gradient: pass manual=...")
            written = manual.get(self.name) if isinstance(manual, Mapping) else (
                manual if self.name == MANUAL else None)
            if written is None:
                raise NotApplicableError(f"engine {self.name!r}: this workload has no such hand-written gradient "
                                         f"(pass manual={{{self.name!r}: ...}})")
            return written
        return self._make_gradient(fun, argnum)


def _manual_namespace(device):
    return namespaces.numpy_namespace() if device.kind == "cpu" else namespaces.torch_namespace()


ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine(
            MANUAL,
            "hand-written backward pass supplied by each workload (NumPy on CPU, torch on CUDA)",
            "numpy",
            None,
            _manual_namespace,
        ),
        Engine(
            MANUAL_SEED,
            "the seed's own hand-written gradient, with its buffer lifetimes (where a workload has one)",
            "numpy",
            None,
            _manual_namespace,
        ),
        Engine(
            BENCHLIB_INPLACE,
            "benchlib.autodiff, gradients accumulated in place and released once used",
            "numpy",
            _benchlib_gradient("inplace"),
            _benchlib_namespace,
        ),
        Engine(
            BENCHLIB_DEFERRED,
            "benchlib.autodiff, every contribution kept until the end then summed (autograd before #219)",
            "numpy",
            _benchlib_gradient("deferred"),
            _benchlib_namespace,
            keeps_contributions=True,
        ),
        Engine(
            BENCHLIB_CHECKPOINT,
            "benchlib.autodiff in place, with about √n forward snapshots; the rest recomputed in the backward pass",
            "numpy",
            _benchlib_gradient("inplace", checkpoint="sqrt"),
            _benchlib_namespace,
        ),
        Engine(
            AUTOGRAD,
            "HIPS autograd on NumPy",
            "numpy",
            _autograd_gradient,
            lambda device: namespaces.autograd_namespace(),
            _cpu_only("HIPS autograd"),
        ),
        Engine(
            TORCH,
            "torch.autograd on torch tensors",
            "torch",
            _torch_gradient,
            lambda device: namespaces.torch_namespace(),
        ),
        Engine(
            TORCH_CHECKPOINT,
            "torch.autograd with the workload's chain cut into ~√n segments under torch.utils.checkpoint (non-reentrant)",
            "torch",
            _torch_gradient,
            lambda device: namespaces.torch_checkpoint_namespace(),
            imports=(DYNAMO,),
        ),
        Engine(
            TORCH_SAC,
            "torch-checkpoint's segments under selective checkpointing: matrix products' outputs saved, the rest "
            "recomputed",
            "torch",
            _torch_gradient,
            lambda device: namespaces.torch_checkpoint_namespace(selective=True),
            imports=(DYNAMO,),
        ),
        Engine(
            TORCH_AUTOCAST,
            f"torch.autograd with the forward pass under autocast to {AUTOCAST_DTYPE} (float32 data only); its "
            f"gradient is judged with {AUTOCAST_DTYPE}'s tolerance, and array by array for a lost array",
            "torch",
            _autocast_torch_gradient,
            lambda device: namespaces.torch_namespace(),
            lowers_to=AUTOCAST_DTYPE,
        ),
        Engine(
            TORCH_COMPILE,
            "torch.autograd through torch.compile (inductor) of the loss, compiled in the set-up: compile time is "
            "recorded apart (compile_time), never in a measured call",
            "torch",
            _compiled_torch_gradient,
            lambda device: namespaces.torch_namespace(),
            compiles=True,
            imports=(DYNAMO,),
        ),
    )
}

ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def get_engine(name: str) -> Engine:
    """The engine called `name`; an unknown name is a ValueError listing the valid ones."""
    try:
        return ENGINES[name]
    except (KeyError, TypeError):
        raise Refused(f"unknown engine {name!r}; valid engines: {', '.join(ENGINE_NAMES)}") from None


def case_imports(name: str, device) -> tuple[str, ...]:
    """What an isolated case of engine `name` imports during its set-up or first call anyway: torch where it
    computes with torch tensors on `device` (`Engine.array_library`), with what the engine imports beyond it
    (`Engine.imports`), and torch alone for a model file's engines, which are not in this registry
    (`torch.func`, `fused-optimizer`; `Combination.imports` adds theirs). A fork template preloads
    them (`IsolationOptions.preload`), so a numpy engine's process holds no torch."""
    engine = ENGINES.get(name)
    if engine is None:
        return ("torch",)
    return ("torch", *engine.imports) if engine.array_library(device) == "torch" else ()
