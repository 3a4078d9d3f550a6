"""Where in a model a technique acts, read from the model's structure: the repeated blocks torch users
checkpoint, the modules that draw random numbers, and how a batch splits into equal micro-batches."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchlib.engine_names import TORCH_CHECKPOINT
from benchlib.errors import Refused

if TYPE_CHECKING:  # torch is imported where a model is read, not where a run is planned
    import torch


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
    import torch

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
    import torch

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


def checkpoint_params(model: torch.nn.Module) -> dict | None:
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


def _segments(model: torch.nn.Sequential) -> int:
    return max(1, round(math.sqrt(len(model))))


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


def wrap_checkpoint_targets(model: torch.nn.Module, checkpoint: Callable) -> None:
    """Run each of `checkpoint_targets(model)` through `checkpoint` (a configured torch.utils.checkpoint)."""
    import functools

    for target in checkpoint_targets(model):
        if target.segments > 1:
            target.module.forward = functools.partial(_segments_checkpointed, checkpoint, list(target.module),
                                                      target.segments)
        elif target.whole:
            target.module.forward = functools.partial(checkpoint, target.module.forward)
        else:
            for block in target.module.children():
                block.forward = functools.partial(checkpoint, block.forward)


def checkpoint_blocks(model: torch.nn.Module) -> list[str]:
    """The module paths a checkpoint can be put on one by one, where torch users put them: every block of every
    stack of repeated blocks (`block_stacks`), else each top-level child whose forward takes one tensor."""
    stacks = block_stacks(model)
    if stacks:
        return [f"{path}.{name}" if path else name for path, stack in stacks for name, _ in stack.named_children()]
    return [name for name, _ in checkpointable_children(model)]


_RANGE = re.compile(r"^(?:(?P<stack>.+)\.)?(?P<first>\d+)-(?P<last>\d+)$")


def module_spec(paths: list[str]) -> str:
    """Module paths as an engine name's bracket says them: consecutive blocks of one stack as a range
    (`encoder.layers.0-5`), the rest as they are, joined by commas (`parse_module_spec` reads them back)."""
    groups: list[list] = []  # [stack, first, last] or [path]
    for path in paths:
        stack, _, index = path.rpartition(".") if "." in path else ("", "", path)
        last = groups[-1] if groups else None
        if index.isdigit() and last is not None and len(last) == 3 and last[0] == stack and last[2] + 1 == int(index):
            last[2] = int(index)
        else:
            groups.append([stack, int(index), int(index)] if index.isdigit() else [path])
    return ",".join(group[0] if len(group) == 1 else
                    (f"{group[0]}." if group[0] else "") + (f"{group[1]}" if group[1] == group[2] else f"{group[1]}-{group[2]}")
                    for group in groups)


def checkpointing(paths: list[str]) -> str:
    """The engine that checkpoints exactly these blocks: `torch-checkpoint[encoder.layers.0-5]`."""
    return f"{TORCH_CHECKPOINT}[{module_spec(paths)}]"


def parse_module_spec(spec: str) -> tuple[str, ...]:
    """The module paths an engine name's bracket names: paths and ranges of blocks joined by commas."""
    paths: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise Refused(f"[{spec}] names an empty module path; give paths or ranges such as encoder.layers.0-5")
        match = _RANGE.match(item)
        if match is None:
            paths.append(item)
            continue
        first, last = int(match["first"]), int(match["last"])
        if last < first:
            raise Refused(f"{item}: a range of blocks runs from the lower index to the higher (e.g. 0-5)")
        prefix = f"{match['stack']}." if match["stack"] else ""
        paths += [f"{prefix}{index}" for index in range(first, last + 1)]
    nested = [(outer, inner) for outer in paths for inner in paths if inner.startswith(f"{outer}.")]
    if nested:
        outer, inner = nested[0]
        raise Refused(f"[{spec}] names {inner} inside {outer}: a block is recomputed whole, so a module within it "
                      f"cannot be checkpointed apart; name {outer} or the modules inside it, not both")
    return tuple(dict.fromkeys(paths))


def split_batch(batch: tuple, parts: int) -> list[tuple]:
    """The batch as `parts` equal micro-batches along the first dimension of its tensors (those of the
    first tensor's length; anything else is passed whole to each), or NotApplicable."""
    import torch
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
    gradients and without random draws: every module but the batch-statistics norms in evaluation mode (an
    attention block passes its dropout to its kernel only in training mode), the random stream and the
    model's buffers left as they were."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    from benchlib.measure.case_child import NotApplicable

    quieted = [module for module in model.modules() if module.training and not isinstance(module, _BatchNorm)]
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        for module in quieted:
            module.training = False  # this module alone: train(False) would reach its batch-norm children
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            whole = float(loss(model, *batch))
            parts = [float(loss(model, *chunk)) for chunk in chunks]
    finally:
        for module in quieted:
            module.training = True
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
