"""benchlib's own step techniques (docs/techniques.md): eager torch, torch.func, activation checkpointing
(full and selective), the optimizer fused into backward, bfloat16 autocast, micro-batches, activations
offloaded to the host, and torch.compile at several activation memory budgets. Declaring them imports no
torch (a run plans without it); a technique imports torch where it acts on a step."""

from __future__ import annotations

import functools
import re
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from benchlib.engine_names import (FUSED_OPTIMIZER, TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_COMPILE,
                                   TORCH_COMPILE_BUDGETS, TORCH_FUNC, TORCH_MICROBATCH, TORCH_OFFLOAD, TORCH_SAC)
from benchlib.engines import AUTOCAST_DTYPE, DYNAMO, compiling
from benchlib.engines.namespaces import sac_contexts
from benchlib.engines.techniques.base import Aspect, Misnamed, Need, Technique, first_line
from benchlib.engines.techniques.modules import (checkpoint_blocks, checkpoint_params, checkpoint_targets,
                                                 microbatch_scale, module_spec, split_batch, wrap_checkpoint_targets)

if TYPE_CHECKING:
    import torch

# What torch says when torch.func meets code it cannot transform (an autograd.Function without
# setup_context, an in-place update of a captured tensor, a tensor without storage): the technique does
# not apply to the file; the file is not wrong.
TRANSFORM_LIMIT = re.compile(r"functorch|torch\.func|setup_context|\btransforms?\b|doesn't have storage")
# What torch's selective checkpoint says when a recomputed forward calls ops the first forward did not (code
# that branches on state the first pass changed, as transformers' attention-mask and cache code can).
SAC_RECOMPUTE_LIMIT = re.compile(r"encountered during backward but not found in storage|recomputed .* differ")
COMPILED_UNTRACED = "a compiled step is not traced under fake tensors here"


class Eager(Technique):
    name = TORCH
    description = "eager autograd: loss(model, *batch).backward(), then the optimizer's step"
    runs_file_step = True


class Functional(Technique):
    name = TORCH_FUNC
    description = "torch.func.grad over functional_call of the parameters"
    changes = frozenset({Aspect.GRADIENT})
    imports = (DYNAMO,)
    observes_gradients = True
    hides_saved = "transformed tensors have no storage for saved-tensor hooks to read"

    def refuses(self, other: Technique) -> str | None:
        if Aspect.PLACEMENT in other.changes:  # measured: every rank stepped on its own gradient, 0.4-8x off
            return (f"torch.func computes the gradient with grad(), outside autograd's backward, whose hooks "
                    f"{other.name} reduces the ranks' gradients in: each rank would step on its own gradient")
        acting = other.changes & {Aspect.SAVING, Aspect.BATCH, Aspect.OPTIMIZER}
        if acting:
            return (f"torch.func computes the gradient with grad(), outside autograd's backward, where {other.name} "
                    f"changes {', '.join(sorted(aspect.value for aspect in acting))}")
        return None

    def prepare(self, step) -> None:
        import torch

        from benchlib.engines.techniques.loss_module import LossModule

        wrapper = LossModule(step.model, step.contextual_loss)
        self.detached = {f"model.{name}": p.detach() for name, p in step.named}
        # buffers go in as arguments: a transformed function may update its inputs (BatchNorm's running
        # statistics), never a tensor it captured
        self.buffers = {f"model.{name}": b for name, b in step.model.named_buffers()}
        self.grad = torch.func.grad(
            lambda params, buffers, batch: torch.func.functional_call(wrapper, (params, buffers), batch))

    def differentiate(self, step, batch: tuple, scale: float) -> None:
        gradients = self.grad(self.detached, self.buffers, batch)
        for (name, p), key in zip(step.named, self.detached):
            if step.observer is not None:
                step.observer(name, gradients[key])
            if step.optimizers:
                p.grad = gradients[key]
        del gradients

    def limit(self, error: BaseException) -> str | None:
        return f"torch.func cannot transform this step: {first_line(error)}" if TRANSFORM_LIMIT.search(str(error)) \
            else None


class Checkpoint(Technique):
    name = TORCH_CHECKPOINT
    description = ("non-reentrant torch.utils.checkpoint where torch users put it: each stack of repeated blocks, "
                   "else the longest nn.Sequential in √n segments, else each top-level child; or on the modules "
                   "its name gives (torch-checkpoint[encoder.layers.0-5])")
    changes = frozenset({Aspect.SAVING})
    imports = (DYNAMO,)
    runs_file_step = True
    takes_modules = True

    def not_applicable(self, model, facts) -> str | None:
        if self.modules:
            missing = [path for path in self.modules if not _has_module(model, path)]
            if missing:  # asked for by name: a misspelt path fails the steps that asked (Misnamed), never "n/a"
                raise Misnamed(f"the model ({type(model).__name__}) has no module {module_spec(missing)}; its blocks: "
                               f"{module_spec(checkpoint_blocks(model)) or 'none'}")
            return None
        if checkpoint_targets(model):
            return None
        return (f"the model ({type(model).__name__}) is not an nn.Sequential, holds no nn.Sequential or "
                "nn.ModuleList of two blocks or more, and has no top-level child whose forward takes one tensor: "
                "nothing to checkpoint")

    def params(self, model) -> dict:
        if self.modules:
            return {"checkpoint": f"checkpoint of each of {module_spec(list(self.modules))}",
                    "checkpoint_modules": list(self.modules), "checkpoint_segments": len(self.modules)}
        return checkpoint_params(model) or {}

    def checkpoint_options(self) -> dict:
        return {}

    def prepare(self, step) -> None:
        from torch.utils.checkpoint import checkpoint

        _without_generation_cache(step.model)
        # random state preserved (the default): dropout draws the same masks in recomputation
        wrapped = functools.partial(checkpoint, use_reentrant=False, **self.checkpoint_options())
        if not self.modules:
            wrap_checkpoint_targets(step.model, wrapped)
        for path in self.modules:
            module = step.model.get_submodule(path)
            module.forward = functools.partial(wrapped, module.forward)


def _without_generation_cache(model) -> None:
    """A transformers model keeps every layer's keys and values for generation while `config.use_cache` is on: under
    checkpointing, the very activations the blocks would drop (a GPT-2 124M at batch 104: 7.9 GB). transformers'
    own `gradient_checkpointing_enable` turns the cache off in training, and so does this technique."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False


def _has_module(model, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


class Selective(Checkpoint):
    name = TORCH_SAC
    description = ("selective activation checkpointing over torch-checkpoint's targets: matrix-product, convolution "
                   "and attention outputs saved, everything else recomputed")

    def saved_ops(self) -> tuple[str, ...]:
        from benchlib.engines.namespaces import SAC_SAVED_OPS

        return self.options.sac_saved_ops or SAC_SAVED_OPS

    def params(self, model) -> dict:
        return {**super().params(model), "sac_saved_ops": list(self.saved_ops())}

    def checkpoint_options(self) -> dict:
        return {"context_fn": functools.partial(sac_contexts, self.saved_ops())}

    def limit(self, error: BaseException) -> str | None:
        if SAC_RECOMPUTE_LIMIT.search(str(error)):
            return ("torch's selective checkpoint cannot replay this model's forward: its recomputation calls ops "
                    f"the first forward did not ({first_line(error)})")
        return None


class FusedOptimizer(Technique):
    name = FUSED_OPTIMIZER
    description = ("one optimizer per parameter, stepped from its post-accumulate-grad hook, its gradient freed "
                   "right after: the gradients never all exist at once")
    changes = frozenset({Aspect.OPTIMIZER})
    needs = frozenset({Need.OPTIMIZER})
    observes_gradients = True
    regroups_optimizer = ("fused-optimizer steps one optimizer per parameter, made by the file's optimizer(parameters) "
                          "from that parameter alone, and the file's optimizer step is not the same parameter by "
                          "parameter: it couples them (clipping by their global norm) or sets groups of them apart "
                          "(parameter groups with their own settings)")

    def refuses(self, other: Technique) -> str | None:
        if Aspect.BATCH in other.changes:
            return (f"{self.name} steps each parameter's optimizer from its gradient's hook, while {other.name} "
                    "accumulates a gradient over several parts before any step")
        return None

    def prepare(self, step) -> None:
        step.optimizers = [step.optimizer_factory([p]) for _, p in step.named]
        for (name, p), fused in zip(step.named, step.optimizers):
            p.register_post_accumulate_grad_hook(functools.partial(self._step, step, name, fused))

    @staticmethod
    def _step(step, name: str, fused: torch.optim.Optimizer, parameter: torch.Tensor) -> None:
        if step.observer is not None:
            step.observer(name, parameter.grad)
        fused.step()
        fused.zero_grad(set_to_none=True)


class Autocast(Technique):
    name = TORCH_AUTOCAST
    description = f"the forward pass under autocast to {AUTOCAST_DTYPE}"
    changes = frozenset({Aspect.FORWARD})
    needs = frozenset({Need.FLOAT32})
    computes_in = AUTOCAST_DTYPE

    def params(self, model) -> dict:
        return {"autocast": AUTOCAST_DTYPE}

    def forward_context(self, step) -> AbstractContextManager:
        import torch

        return torch.autocast(step.device_type, dtype=getattr(torch, AUTOCAST_DTYPE))


class Microbatch(Technique):
    name = TORCH_MICROBATCH
    description = "the batch in equal micro-batches (-p microbatches=K), gradients accumulated"
    changes = frozenset({Aspect.BATCH})
    untraceable = ("it first checks that the loss is the mean or sum of its micro-batches' losses, reading values "
                   "fake tensors do not hold")

    def params(self, model) -> dict:
        return {"microbatches": self.options.microbatches}

    def batch_multiple(self) -> int:
        return self.options.microbatches

    def prepare(self, step) -> None:
        chunks = split_batch(step.batch, self.options.microbatches)
        scale = microbatch_scale(step.model, step.loss, step.batch, chunks)
        step.parts = [(chunk, scale) for chunk in chunks]


class Offload(Technique):
    name = TORCH_OFFLOAD
    description = "saved activations moved to pinned host memory by save_on_cpu; on the CPU they already live on the host"
    changes = frozenset({Aspect.SAVING})
    needs = frozenset({Need.CUDA})
    runs_file_step = True
    untraceable = "its saved activations move to the host, which a trace on the CPU cannot tell from device memory"
    hides_saved = "save_on_cpu's own hooks take the saved tensors before ours would see them"

    def forward_context(self, step) -> AbstractContextManager:
        import torch

        return torch.autograd.graph.save_on_cpu(pin_memory=True)


class Compile(Technique):
    name = TORCH_COMPILE
    description = "torch.compile of the loss, compiled in the set-up; the partitioner decides what backward saves"
    changes = frozenset({Aspect.GRADIENT, Aspect.SAVING})
    imports = (DYNAMO,)
    untraceable = COMPILED_UNTRACED
    budget = 1.0  # the partitioner's activation memory budget (1.0: all it would save)

    def params(self, model) -> dict:
        return {"compile_backend": str(compiling.COMPILE_BACKEND), "activation_memory_budget": self.budget}

    def prepare(self, step) -> None:
        import torch

        from benchlib.engines.techniques.loss_module import LossModule

        step.forward = compiling.compiled(LossModule(step.model, step.contextual_loss))
        batch, _ = step.parts[0]
        with torch._functorch.config.patch(activation_memory_budget=self.budget):  # read by the partitioner
            step.compile_s = step.first_call(lambda: step.forward(*batch).backward())


def _budgeted(name: str, budget: float) -> type[Compile]:
    """torch.compile at one activation memory budget below 1.0: a point of its own on the frontier."""
    return type(f"Compile{budget:g}".replace(".", "_"), (Compile,), {
        "name": name, "budget": budget,
        "description": f"torch.compile with the partitioner's activation memory budget at {budget:g}"})


BUILTIN = {technique.name: technique for technique in (
    Eager, Functional, Checkpoint, FusedOptimizer, Selective, Autocast, Microbatch, Offload, Compile,
    *(_budgeted(name, budget) for name, budget in TORCH_COMPILE_BUDGETS.items()))}
