"""The engines a closure is differentiated by: shared engines plus torch.compile and torch.func adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable

import numpy as np

from benchlib.errors import Refused
from benchlib.engine_names import TORCH, TORCH_FUNC
from benchlib.engines import Engine, get_engine
from benchlib.engines.functional import array_engine, torch_func_gradient
from benchlib.measure import resolve_device
from benchlib.workloads.closures.spec import (
    COMPILE_ENGINE, FUNC_ENGINE, VALID_ENGINES, COMPILE_BACKENDS, Protocol,
)


class CompileCounter:
    """A torch.compile backend that counts the graphs Dynamo hands it, then compiles them with `backend`."""

    def __init__(self, backend: str):
        import torch._dynamo

        self.backend = backend
        self._compile = torch._dynamo.lookup_backend(backend)
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self._compile(graph_module, example_inputs)

    def wrap(self, fn: Callable) -> Callable:
        from benchlib.engines.compiling import compiled

        return compiled(fn, backend=self)

    @staticmethod
    def cache_entries(code: CodeType) -> int:
        """Compiled entries Dynamo holds for one code object (more than one means it recompiled)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))

    @staticmethod
    def forget_compiled() -> None:
        """Forget every compiled graph, as in a fresh process (on-disk caches stay).

        (Not named `reset`: Dynamo calls a backend's `reset` from torch._dynamo.reset.)"""
        import torch._dynamo

        torch._dynamo.reset()

    def describe(self) -> dict:
        import torch._inductor.config as inductor_config

        return {"backend": self.backend, "fx_graph_cache": bool(inductor_config.fx_graph_cache)}


def _identity(fn: Callable) -> Callable:
    return fn


@dataclass
class ClosureEngine:
    """An engine as this benchmark needs it: gradients, arrays, and what a setup does to its closure.

    torch.compile and torch.func.grad reuse the shared `torch` engine's arrays and namespace; the
    first compiles each loss closure in its setup function (so per code object), the second
    differentiates with torch.func.grad instead of torch.autograd.
    """

    name: str
    base: Engine
    device: Any
    gradient: Callable[[Callable, Any], Callable]
    wrap_loss: Callable[[Callable], Callable] = _identity
    compiler: CompileCounter | None = None
    xp: Any = field(init=False)

    def __post_init__(self):
        self.xp = self.base.namespace(self.device)

    def asarray(self, array: np.ndarray):
        return self.base.asarray(array, self.device)

    def reset(self) -> None:
        """Start a pass as a fresh process would, as far as the engine goes: torch.compile forgets its graphs."""
        if self.compiler is not None:
            self.compiler.forget_compiled()

    def describe(self) -> dict:
        return {} if self.compiler is None else self.compiler.describe()


def _compiled(name: str, device, backend: str) -> ClosureEngine:
    compiler = CompileCounter(backend)
    torch_engine = get_engine(TORCH)
    return ClosureEngine(name, torch_engine, device, torch_engine.gradient, compiler.wrap, compiler)


def _functional(name: str, device, backend: str) -> ClosureEngine:
    return ClosureEngine(name, array_engine(TORCH_FUNC), device, torch_func_gradient)


def _registered(name: str, device, backend: str) -> ClosureEngine:
    engine = get_engine(name)
    return ClosureEngine(name, engine, device, engine.gradient)


# This workload's own engines, adapters over torch (the registry's engine each runs on), and how each is made; every
# other engine is the registry's own.
_ADAPTERS = {COMPILE_ENGINE: _compiled, FUNC_ENGINE: _functional}
_RUNS_ON = dict.fromkeys(_ADAPTERS, TORCH)


def not_applicable(engine: str, device) -> str | None:
    """Why `engine` cannot run on `device` (an adapter: where torch cannot), or None."""
    return get_engine(_RUNS_ON.get(engine, engine)).not_applicable(resolve_device(device))


def make_engine(name: str, device, backend: str = Protocol.backend) -> ClosureEngine:
    """The engine called `name` (one of VALID_ENGINES) on `device`."""
    if name not in VALID_ENGINES:
        raise Refused(f"unknown engine {name!r}; valid: {', '.join(VALID_ENGINES)}")
    if backend not in COMPILE_BACKENDS:
        raise Refused(f"backend must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    return _ADAPTERS.get(name, _registered)(name, resolve_device(device), backend)
