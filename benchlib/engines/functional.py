"""torch.func as an engine over torch's arrays: the one adaptation the array-form model files and
identical_closures both use. It is not in `ENGINES` (the built-in comparisons' engines): it has no
tape of its own, it differentiates with `torch.func.grad` the functions torch's namespace builds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchlib.engine_names import TORCH, TORCH_FUNC
from benchlib.engines import Engine, get_engine


def array_engine(name: str) -> Engine:
    """The engine whose arrays and namespace `name` computes with: torch's for torch.func, else its own."""
    return get_engine(TORCH if name == TORCH_FUNC else name)


def array_not_applicable(name: str, device) -> str | None:
    """Why engine `name` cannot differentiate an array-form loss on `device`: its arrays' engine's reason, or, for
    torch.func, a torch without torch.func.grad."""
    reason = array_engine(name).not_applicable(device)
    if reason is None and name == TORCH_FUNC:
        import torch

        if not hasattr(getattr(torch, "func", None), "grad"):
            reason = f"this torch ({torch.__version__}) has no torch.func.grad"
    return reason


def torch_func_gradient(fun: Callable, argnums: Any) -> Callable:
    """`torch.func.grad` of `fun` with respect to `argnums` (an index or a tuple of them)."""
    import torch.func

    return torch.func.grad(fun, argnums=argnums)


def gradient_maker(name: str) -> Callable[[Callable, Any], Callable]:
    """`(fun, argnums) -> gradient function` of `name`: torch.func.grad, or the registry engine's own."""
    return torch_func_gradient if name == TORCH_FUNC else get_engine(name).gradient
