"""The ways a model file's step runs, each over one model, batch and (optional) optimizer.

`torch`: eager autograd, `loss(model, *batch).backward()`, then the optimizer's step. `torch.func`:
`torch.func.grad` over `functional_call` of the parameters. `torch-checkpoint`: eager autograd with
non-reentrant `torch.utils.checkpoint` where torch users put it (`checkpoint_targets`): every stack of
repeated blocks wherever it lives (block by block; a `Sequential` of four or more in √n segments); else
the model's own or its longest `nn.Sequential` (√n segments); else each top-level child whose forward
takes one tensor. `fused-optimizer`: one optimizer per parameter, stepped from
its post-accumulate-grad hook, its gradient freed right after (NaiveGAflux's idea): the gradients
never all exist at once. The memory techniques a PyTorch user reaches for when a step does not fit
(docs/engines.md): `torch-sac`, selective activation checkpointing over torch-checkpoint's targets
(matrix-product and convolution outputs saved, everything else recomputed); `torch-autocast`, the
forward pass under autocast to bfloat16; `torch-microbatch`, the batch in `MICROBATCHES` equal parts
with gradients accumulated (the loss scaled to the full batch's); `torch-offload`, saved activations
moved to pinned host memory (`save_on_cpu`, CUDA only). Every step ends with no gradient held, so steps
do not accumulate.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from benchlib.engines import AUTOCAST_DTYPE, DYNAMO
from benchlib.engines import compiling
from benchlib.engines.namespaces import SAC_SAVED_OPS, sac_contexts
from benchlib.engine_names import (FUSED_OPTIMIZER, TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_COMPILE,
                                   TORCH_COMPILE_BUDGETS, TORCH_FUNC, TORCH_MICROBATCH, TORCH_OFFLOAD, TORCH_SAC)

COMPILED = {TORCH_COMPILE: 1.0, **TORCH_COMPILE_BUDGETS}  # engine -> the activation memory budget it compiles with
ENGINES = (TORCH, TORCH_FUNC, TORCH_CHECKPOINT, FUSED_OPTIMIZER, TORCH_SAC, TORCH_AUTOCAST, TORCH_MICROBATCH,
           TORCH_OFFLOAD, *COMPILED)
SWEEP_ENGINES = tuple(TORCH_COMPILE_BUDGETS)  # left out of a first look (--quick) and of fit unless named
REFERENCE = TORCH  # every other engine's gradient is checked against eager torch's
HOOKED = (TORCH, TORCH_CHECKPOINT, TORCH_SAC, TORCH_AUTOCAST, TORCH_MICROBATCH, TORCH_OFFLOAD, *COMPILED)
# ^ gradients accumulate in eager autograd (a compiled backward is one node of it): observed by post-accumulate hooks
MICROBATCHES = 4
# Engines whose optimizer step is not the file's even with the same gradient, and why: another update then
# means the engine does not apply to this file (for any other engine it is a failure).
REGROUPS_OPTIMIZER = {FUSED_OPTIMIZER: "fused-optimizer steps one optimizer per parameter, and the file's optimizer "
                                       "step couples parameters (clipping by their global norm, say)"}
# torch.optim, torch.func, checkpoint and the compiler import the dynamo stack on first use (0.8 s on a 2-core
# machine): a fork template preloads it for the cases whose step would (`step_imports`, `forkserver.LAZY_IMPORTS`)
IMPORT_DYNAMO = (TORCH_FUNC, TORCH_CHECKPOINT, TORCH_SAC, *COMPILED)  # whatever the file; the rest via its optimizer
Observer = Callable[[str, torch.Tensor], None]
# What torch says when torch.func meets code it cannot transform (an autograd.Function without
# setup_context, an in-place update of a captured tensor, a tensor without storage): the engine does
# not apply to the file; the file is not wrong.
TRANSFORM_LIMIT = re.compile(r"functorch|torch\.func|setup_context|\btransforms?\b|doesn't have storage")


def step_imports(engine: str, has_optimizer: bool) -> tuple[str, ...]:
    """What an engine's step imports beyond torch the first time it runs (a test runs each engine to check)."""
    return (DYNAMO,) if engine in IMPORT_DYNAMO or (has_optimizer and engine in ENGINES) else ()


def stochastic_modules(model: torch.nn.Module) -> list[str]:
    """The modules of `model` that draw random numbers in training mode: dropout layers with p > 0 and
    layers with a `dropout` probability > 0 (recurrent stacks, attention). Their gradients depend on
    the random stream, so a comparison of gradients needs the same draws."""
    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        p = getattr(module, "p", None) if "dropout" in type(module).__name__.lower() else getattr(module, "dropout", None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            found.append(name or type(module).__name__)
    return found


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


def _one_type_of_block(module: torch.nn.Module) -> bool:
    children = list(module.children())
    return len(children) >= 2 and len({type(child) for child in children}) == 1


def block_stacks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every `nn.Sequential` or `nn.ModuleList` of two or more blocks of one type, wherever it lives (a
    ResNet's `layer1`..`layer4`, a transformer's `encoder.layers`), outermost first and none inside
    another: the repeated blocks torch users checkpoint. A mixed container (`Linear, GELU, Linear`) is
    one block's insides, not a stack."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(not outer or name.startswith(f"{outer}.") for outer, _ in found)
        if not inside and isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)) and _one_type_of_block(module):
            found.append((name, module))
    return found


@dataclass(frozen=True)
class CheckpointTarget:
    """One module torch-checkpoint wraps: `segments` > 1 runs it as `checkpoint_sequential` in that many
    segments (torch checkpoints all but the last), else each of its blocks (or itself, `whole`) is checkpointed."""

    path: str
    module: torch.nn.Module
    segments: int = 0
    whole: bool = False

    def checkpointed(self) -> list[str]:
        """The paths of the modules (or segments) whose activations are recomputed."""
        where = self.path or "(model)"
        if self.segments > 1:
            return [f"{where} segment {index + 1}/{self.segments}" for index in range(self.segments - 1)]
        if self.whole:
            return [where]
        return [f"{self.path}.{name}" if self.path else name for name, _ in self.module.named_children()]

    def words(self) -> str:
        kind = type(self.module).__name__
        if self.segments > 1:
            return (f"checkpoint_sequential{f' of {self.path}' if self.path else ''}, {self.segments} segments of "
                    f"{len(self.module)} modules")
        if self.whole:
            return self.path
        return f"checkpoint of each of the {len(list(self.module.children()))} blocks of {self.path or 'the model'} (nn.{kind})"


def checkpoint_targets(model: torch.nn.Module) -> list[CheckpointTarget]:
    """What torch-checkpoint wraps in `model`, where torch users put checkpoints: every stack of repeated
    blocks (`block_stacks`; a `Sequential` of four or more in about √n segments, else block by block);
    else the model's own, or its longest, mixed `nn.Sequential` in √n segments; else each top-level child
    whose forward takes one tensor. Empty when nothing can be."""
    targets = [CheckpointTarget(name, module, _segments(module) if isinstance(module, torch.nn.Sequential)
                                and len(module) >= 4 else 0) for name, module in block_stacks(model)]
    if not targets:  # no repeated blocks: the model's own, or its longest, mixed Sequential in √n segments
        longest = max(((name, module) for name, module in model.named_modules()
                       if isinstance(module, torch.nn.Sequential) and (len(module) >= 2 or module is model)),
                      key=lambda item: (item[1] is model, len(item[1])), default=None)
        if longest is not None:
            segments = _segments(longest[1])
            targets = [CheckpointTarget(*longest, segments if segments > 1 else 0)]
    if targets:
        return targets
    return [CheckpointTarget(name, child, whole=True) for name, child in checkpointable_children(model)]


def checkpoint_plan(model: torch.nn.Module) -> dict | None:
    """What torch-checkpoint checkpoints in `model`, as its records carry it: `checkpoint` in words,
    `checkpoint_modules` (the paths recomputed in backward) and `checkpoint_segments` (how many); None
    when nothing can be."""
    targets = checkpoint_targets(model)
    if not targets:
        return None
    whole = [target.path for target in targets if target.whole]
    words = [target.words() for target in targets if not target.whole]
    words += [f"checkpoint of each of {', '.join(whole)}"] if whole else []
    modules = [path for target in targets for path in target.checkpointed()]
    return {"checkpoint": "; ".join(words), "checkpoint_modules": modules, "checkpoint_segments": len(modules)}


def not_applicable(engine: str, model: torch.nn.Module, has_optimizer: bool, has_step: bool = False,
                   device_kind: str = "cpu") -> str | None:
    """Why `engine` cannot run this file's step on a `device_kind` device, or None. A file's own `step` is
    run as written by the engines that change only how the model's forward saves (torch, torch-checkpoint,
    torch-sac, torch-offload); the others would compute another step."""
    if has_step and engine in (TORCH_AUTOCAST, TORCH_MICROBATCH, *COMPILED):
        how = {TORCH_AUTOCAST: "under autocast", TORCH_MICROBATCH: "on micro-batches"}.get(
            engine, "compiled (it compiles loss(model, *batch))")
        return (f"the file's step(model, optimizer, *batch) runs its own forward and backward; {engine} cannot run "
                f"that step {how} as written")
    if engine == TORCH_OFFLOAD and device_kind != "cuda":
        return ("activations already live on the host: save_on_cpu would copy them from host memory to host memory "
                "(it applies on CUDA)")
    if engine == TORCH_AUTOCAST:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        if dtype != torch.float32:
            return (f"autocast lowers float32 operations to {AUTOCAST_DTYPE}; this model's parameters are "
                    f"{str(dtype).removeprefix('torch.')}")
    if has_step and engine == TORCH_FUNC:
        return ("the file's step(model, optimizer, *batch) runs its own backward; torch.func differentiates loss "
                "with grad() and cannot run that step as written")
    if has_step and engine == FUSED_OPTIMIZER:
        return ("the file's step(model, optimizer, *batch) calls its optimizer itself; fused-optimizer steps one "
                "optimizer per parameter from backward and cannot run that step as written")
    if engine == FUSED_OPTIMIZER and not has_optimizer:
        return "the file declares no optimizer(parameters): there is no optimizer step to fuse into backward"
    if engine in (TORCH_CHECKPOINT, TORCH_SAC) and not checkpoint_targets(model):
        return (f"the model ({type(model).__name__}) is not an nn.Sequential, holds no nn.Sequential or "
                "nn.ModuleList of two blocks or more, and has no top-level child whose forward takes one tensor: "
                "nothing to checkpoint")
    return None


def _segments(model: torch.nn.Sequential) -> int:
    return max(1, round(math.sqrt(len(model))))


def unknown_aten_ops(names) -> list[str]:
    """The names in `names` that are no op of `torch.ops.aten` (a SAC policy naming them would save nothing)."""
    return [name for name in names if not hasattr(torch.ops.aten, name)]


def _segments_checkpointed(checkpoint: Callable, modules: list[torch.nn.Module], segments: int, x):
    """`checkpoint_sequential`'s split: `segments` runs of len // segments modules, every run but the last
    through `checkpoint`, the last (with the remainder) as is."""
    size = len(modules) // segments

    def run(part):
        def forward(value):
            for module in part:
                value = module(value)
            return value
        return forward

    for start in range(0, size * (segments - 1), size):
        x = checkpoint(run(modules[start:start + size]), x)
    return run(modules[size * (segments - 1):])(x)


def _checkpoint(model: torch.nn.Module, saved_ops: tuple[str, ...] | None = None) -> None:
    """Wrap `checkpoint_targets(model)` in non-reentrant checkpoints (random state preserved: dropout
    draws the same masks in recomputation); given `saved_ops`, selective: torch-sac's policy (`sac_contexts`)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    selective = {} if saved_ops is None else {"context_fn": functools.partial(sac_contexts, tuple(saved_ops))}
    checkpoint = functools.partial(torch_checkpoint, use_reentrant=False, **selective)
    for target in checkpoint_targets(model):
        if target.segments > 1:
            target.module.forward = functools.partial(_segments_checkpointed, checkpoint, list(target.module),
                                                      target.segments)
        elif target.whole:
            target.module.forward = functools.partial(checkpoint, target.module.forward)
        else:
            for block in target.module.children():
                block.forward = functools.partial(checkpoint, block.forward)


def split_batch(batch: tuple, parts: int) -> list[tuple]:
    """The batch as `parts` equal micro-batches along the first dimension of its tensors (those of the
    first tensor's length; anything else is passed whole to each), or NotApplicable."""
    from benchlib.measure.case_child import NotApplicable

    tensors = [item for item in batch if isinstance(item, torch.Tensor) and item.dim() > 0]
    if not tensors:
        raise NotApplicable("the batch holds no tensor with a batch dimension to split into micro-batches")
    size = tensors[0].shape[0]
    if size < parts or size % parts:
        raise NotApplicable(f"the batch of {size} samples does not split into {parts} equal micro-batches")
    split = [item.chunk(parts) if isinstance(item, torch.Tensor) and item.dim() > 0 and item.shape[0] == size
             else None for item in batch]
    return [tuple(item if chunks is None else chunks[index] for item, chunks in zip(batch, split))
            for index in range(parts)]


def microbatch_scale(model: torch.nn.Module, loss: Callable, batch: tuple, chunks: list[tuple]) -> float:
    """What each micro-batch's loss is multiplied by so that the accumulated gradient is the full batch's:
    1/k when the batch's loss is the mean of its k micro-batches' losses, 1 when it is their sum, else
    NotApplicable (the loss uses statistics of the whole batch, BatchNorm's say). Checked once, without
    gradients, dropout off, the random stream and the model's buffers left as they were."""
    from benchlib.measure.case_child import NotApplicable

    stochastic = set(stochastic_modules(model))
    dropping = [module for name, module in model.named_modules() if (name or type(module).__name__) in stochastic]
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        for module in dropping:
            module.train(False)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            whole = float(loss(model, *batch))
            parts = [float(loss(model, *chunk)) for chunk in chunks]
    finally:
        for module in dropping:
            module.train(True)
        for buffer, saved in buffers:
            buffer.copy_(saved)
    total, count = sum(parts), len(parts)
    if not all(math.isfinite(value) for value in (whole, *parts)):  # no scale to judge: the step's own gradient
        return 1.0 / count                                           # check fails it, as it fails every engine
    if math.isclose(whole, total / count, rel_tol=1e-4, abs_tol=1e-7):
        return 1.0 / count
    if math.isclose(whole, total, rel_tol=1e-4, abs_tol=1e-7):
        return 1.0
    raise NotApplicable(f"the batch's loss ({whole:.6g}) is neither the mean ({total / count:.6g}) nor the sum "
                        f"({total:.6g}) of its {count} micro-batches' losses: the step uses statistics of the whole "
                        "batch (BatchNorm, say), so micro-batches would compute another step")


class _Loss(torch.nn.Module):
    """The user's loss as a module over the model, so `functional_call` swaps the parameters the loss reads."""

    def __init__(self, model: torch.nn.Module, loss: Callable):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *batch):
        return self.loss(self.model, *batch)


class Step:
    """One training step of `engine`; calling it runs forward, backward and (if any) the optimizer step,
    or, given the file's own `step`, that step as written (torch and torch-checkpoint only).

    `observe(fn)` calls `fn(name, gradient)` as each parameter's gradient is complete, for one
    extra step outside the measured ones: the gradient check and the gradient role read it.
    """

    def __init__(self, engine: str, model: torch.nn.Module, batch: tuple, loss: Callable,
                 optimizer: Callable | None, step: Callable | None = None, sac_saved_ops: tuple = SAC_SAVED_OPS):
        self.engine, self.model, self.batch, self.loss, self.step = engine, model, batch, loss, step
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.observer: Observer | None = None
        if engine == FUSED_OPTIMIZER:
            self.optimizers = [optimizer([p]) for _, p in self.named]
            for (name, p), fused in zip(self.named, self.optimizers):
                p.register_post_accumulate_grad_hook(functools.partial(self._fused_step, name, fused))
        else:
            self.optimizers = [optimizer(p for _, p in self.named)] if optimizer is not None else []
        if engine in (TORCH_CHECKPOINT, TORCH_SAC):
            _checkpoint(model, sac_saved_ops if engine == TORCH_SAC else None)
        self.final_pass = True  # False while a micro-batch other than the last runs: its gradients are partial
        if engine == TORCH_MICROBATCH:
            self.chunks = split_batch(batch, MICROBATCHES)
            self.scale = microbatch_scale(model, loss, batch, self.chunks)
        first = next((p for _, p in self.named), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self.compile_s = None
        if engine in COMPILED:
            self.compiled = torch.compile(_Loss(model, loss), backend=compiling.COMPILE_BACKEND)
            with torch._functorch.config.patch(activation_memory_budget=COMPILED[engine]):  # read by the partitioner
                self.compile_s = self._compile(str(first.device) if first is not None else "cpu")
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

    def _compile(self, device: str) -> float:
        """Seconds of the compiled loss's first forward and backward, which trace and compile it: here, in the
        set-up, so no measured step pays them. The gradients it leaves are dropped."""
        try:
            return compiling.compile_first_call(lambda: self.compiled(*self.batch).backward(), device)
        finally:
            for _, p in self.named:
                p.grad = None

    def _transformed(self) -> dict:
        """torch.func's gradient; an error that is torch.func's limit, not the file's, is `NotApplicable`."""
        from benchlib.measure.case_child import NotApplicable

        try:
            return self.grad(self.detached, self.buffers)
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if TRANSFORM_LIMIT.search(str(error)):
                raise NotApplicable(f"torch.func cannot transform this step: {first}") from error
            raise

    def __call__(self) -> None:
        if self.engine == TORCH_FUNC:
            gradients = self._transformed()
            for (name, p), key in zip(self.named, self.detached):
                if self.observer is not None:
                    self.observer(name, gradients[key])
                if self.optimizers:
                    p.grad = gradients[key]
            del gradients
        elif self.step is not None:  # the file's own step: backward, clipping, the optimizer's step, as written
            with self._saving():
                self.step(self.model, self.optimizers[0] if self.optimizers else None, *self.batch)
            for _, p in self.named:
                p.grad = None
            return
        elif self.engine == TORCH_MICROBATCH:
            for index, chunk in enumerate(self.chunks):
                self.final_pass = index == len(self.chunks) - 1
                (self.loss(self.model, *chunk) * self.scale).backward()
        elif self.engine in COMPILED:
            loss = self.compiled(*self.batch)
            loss.backward()
            del loss
        elif self.engine == TORCH_AUTOCAST:
            with torch.autocast(self.device_type, dtype=getattr(torch, AUTOCAST_DTYPE)):
                loss = self.loss(self.model, *self.batch)
            loss.backward()
            del loss
        else:
            with self._saving():
                loss = self.loss(self.model, *self.batch)
            loss.backward()
            del loss
        if self.engine == FUSED_OPTIMIZER:
            return
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for _, p in self.named:
            p.grad = None

    def _saving(self):
        """Where the forward pass saves for backward: on the host for torch-offload, else as torch does."""
        if self.engine == TORCH_OFFLOAD:
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return nullcontext()

    def _observed(self, fn: Observer, name: str, parameter: torch.Tensor) -> None:
        if self.final_pass:  # a post-accumulate-grad hook must return None
            fn(name, parameter.grad)

    @contextmanager
    def observe(self, fn: Observer) -> Iterator[None]:
        handles = []
        if self.engine in HOOKED:
            handles = [p.register_post_accumulate_grad_hook(functools.partial(self._observed, fn, name))
                       for name, p in self.named]
        self.observer = fn
        try:
            yield
        finally:
            self.observer = None
            for handle in handles:
                handle.remove()


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
