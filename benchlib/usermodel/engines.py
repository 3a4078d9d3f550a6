"""The four ways a model file's step runs, each over one model, batch and (optional) optimizer.

`torch`: eager autograd, `loss(model, *batch).backward()`, then the optimizer's step. `torch.func`:
`torch.func.grad` over `functional_call` of the parameters. `torch-checkpoint`: eager autograd with
non-reentrant `torch.utils.checkpoint` where torch users put it: about √n segments of an
`nn.Sequential` model; else on the model's repeated blocks, its longest `nn.Sequential` (√n segments)
or `nn.ModuleList` (each block, as transformer stacks are checkpointed); else each top-level child
whose forward takes one tensor. `fused-optimizer`: one optimizer per parameter, stepped from
its post-accumulate-grad hook, its gradient freed right after (NaiveGAflux's idea): the gradients
never all exist at once. Every step ends with no gradient held, so steps do not accumulate.
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchlib.engine_names import FUSED_OPTIMIZER, TORCH, TORCH_CHECKPOINT, TORCH_FUNC

ENGINES = (TORCH, TORCH_FUNC, TORCH_CHECKPOINT, FUSED_OPTIMIZER)
REFERENCE = TORCH  # every other engine's gradient is checked against eager torch's
Observer = Callable[[str, torch.Tensor], None]


def checkpointable_children(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Top-level children whose forward takes exactly one required positional argument (a tensor)."""
    found = []
    for name, child in model.named_children():
        try:
            parameters = list(inspect.signature(child.forward).parameters.values())
        except (TypeError, ValueError):
            continue
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in parameters if p.kind in positional and p.default is p.empty]
        if len(required) == 1 and not any(p.kind == p.VAR_POSITIONAL for p in parameters):
            found.append((name, child))
    return found


def repeated_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The model's longest `nn.Sequential` or `nn.ModuleList` below the top (of two blocks or more; the
    first met of that length): where the activations that checkpointing saves are made."""
    found = None
    for name, module in model.named_modules():
        if name and isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)) and len(module) >= 2 \
                and (found is None or len(module) > len(found[1])):
            found = (name, module)
    return found


def checkpoint_plan(model: torch.nn.Module) -> str | None:
    """What torch-checkpoint checkpoints in `model`, in words; None when nothing can be."""
    if isinstance(model, torch.nn.Sequential) and len(model):
        return f"checkpoint_sequential, {_segments(model)} segments of {len(model)} modules"
    blocks = repeated_blocks(model)
    if blocks is not None:
        name, module = blocks
        if isinstance(module, torch.nn.Sequential):
            return f"checkpoint_sequential of {name}, {_segments(module)} segments of {len(module)} modules"
        return f"checkpoint of each of the {len(module)} blocks of {name} (nn.ModuleList)"
    children = checkpointable_children(model)
    return f"checkpoint of each of {', '.join(name for name, _ in children)}" if children else None


def not_applicable(engine: str, model: torch.nn.Module, has_optimizer: bool) -> str | None:
    """Why `engine` cannot run this file's step, or None."""
    if engine == FUSED_OPTIMIZER and not has_optimizer:
        return "the file declares no optimizer(parameters): there is no optimizer step to fuse into backward"
    if engine == TORCH_CHECKPOINT and checkpoint_plan(model) is None:
        return (f"the model ({type(model).__name__}) is not an nn.Sequential, holds no nn.Sequential or "
                "nn.ModuleList of two blocks or more, and has no top-level child whose forward takes one tensor: "
                "nothing to checkpoint")
    return None


def _segments(model: torch.nn.Sequential) -> int:
    return max(1, round(math.sqrt(len(model))))


def _checkpoint(model: torch.nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    def in_segments(sequential: torch.nn.Sequential) -> None:
        segments = _segments(sequential)
        sequential.forward = lambda x: checkpoint_sequential(sequential, segments, x, use_reentrant=False)

    if isinstance(model, torch.nn.Sequential):
        in_segments(model)
        return
    blocks = repeated_blocks(model)
    if blocks is not None and isinstance(blocks[1], torch.nn.Sequential):
        in_segments(blocks[1])
        return
    for child in blocks[1] if blocks is not None else (child for _, child in checkpointable_children(model)):
        child.forward = functools.partial(checkpoint, child.forward, use_reentrant=False)


class _Loss(torch.nn.Module):
    """The user's loss as a module over the model, so `functional_call` swaps the parameters the loss reads."""

    def __init__(self, model: torch.nn.Module, loss: Callable):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *batch):
        return self.loss(self.model, *batch)


class Step:
    """One training step of `engine`; calling it runs forward, backward and (if any) the optimizer step.

    `observe(fn)` calls `fn(name, gradient)` as each parameter's gradient is complete, for one
    extra step outside the measured ones: the gradient check and the gradient role read it.
    """

    def __init__(self, engine: str, model: torch.nn.Module, batch: tuple, loss: Callable,
                 optimizer: Callable | None):
        self.engine, self.model, self.batch, self.loss = engine, model, batch, loss
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.observer: Observer | None = None
        if engine == FUSED_OPTIMIZER:
            self.optimizers = [optimizer([p]) for _, p in self.named]
            for (name, p), fused in zip(self.named, self.optimizers):
                p.register_post_accumulate_grad_hook(functools.partial(self._fused_step, name, fused))
        else:
            self.optimizers = [optimizer(p for _, p in self.named)] if optimizer is not None else []
        if engine == TORCH_CHECKPOINT:
            _checkpoint(model)
        if engine == TORCH_FUNC:
            wrapper = _Loss(model, loss)
            self.detached = {f"model.{name}": p.detach() for name, p in self.named}
            # buffers go in as arguments: a transformed function may update its inputs (BatchNorm's
            # running statistics), never a tensor it captured
            self.buffers = {f"model.{name}": b for name, b in model.named_buffers()}
            self.grad = torch.func.grad(
                lambda params, buffers: torch.func.functional_call(wrapper, (params, buffers), batch))

    def _fused_step(self, name: str, fused: torch.optim.Optimizer, parameter: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(name, parameter.grad)
        fused.step()
        fused.zero_grad(set_to_none=True)

    def __call__(self) -> None:
        if self.engine == TORCH_FUNC:
            gradients = self.grad(self.detached, self.buffers)
            for (name, p), key in zip(self.named, self.detached):
                if self.observer is not None:
                    self.observer(name, gradients[key])
                if self.optimizers:
                    p.grad = gradients[key]
            del gradients
        else:
            self.loss(self.model, *self.batch).backward()
        if self.engine == FUSED_OPTIMIZER:
            return
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for _, p in self.named:
            p.grad = None

    @contextmanager
    def observe(self, fn: Observer) -> Iterator[None]:
        handles = []
        if self.engine in (TORCH, TORCH_CHECKPOINT):
            handles = [p.register_post_accumulate_grad_hook(functools.partial(_observed, fn, name))
                       for name, p in self.named]
        self.observer = fn
        try:
            yield
        finally:
            self.observer = None
            for handle in handles:
                handle.remove()


def _observed(fn: Observer, name: str, parameter: torch.Tensor) -> None:
    fn(name, parameter.grad)  # a post-accumulate-grad hook must return None


class LiveBytes:
    """The bytes of distinct tensor storages handed to `add` that are still alive, and the most at once."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.bytes = self.peak_bytes = 0

    def add(self, _name: str, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        if key in self.live:
            return
        self.live[key] = tensor.untyped_storage().nbytes()
        self.bytes += self.live[key]
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        self.bytes -= self.live.pop(key, 0)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())
