"""Array namespaces (`xp`) with one set of names, so a loss is written once for every engine.

`benchlib.autodiff.ops` is the reference: `dot`, `matmul`, `tanh`, `exp`, `log`, `sqrt`, `sum`, `mean`
and `max` (`axis`, `keepdims`), `reshape`, `transpose`, `maximum`, `relu`, `where`, `concatenate`
and `stack` (`axis`), `arange` (integers to index with), with NumPy's semantics, and the
losses `mse(prediction, target)` (mean squared error) and `softmax_cross_entropy(logits, labels)`
(mean over rows; labels are integer class indices (N,) or probabilities (N, classes)), and
`chain(step, state, steps)`, a loop an engine may checkpoint. The namespaces here give NumPy, HIPS autograd and torch the same names and semantics, so that the
same loss runs under each engine and a hand-written gradient runs on NumPy or on torch tensors.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from benchlib.engine_names import TORCH_CHECKPOINT, TORCH_SAC

# The aten ops whose outputs torch-sac saves (expensive to recompute); every other op is recomputed
SAC_SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")

OP_NAMES = ("dot", "matmul", "tanh", "exp", "log", "sqrt", "sum", "mean", "max", "reshape", "transpose", "maximum",
            "relu", "where", "concatenate", "stack", "arange", "mse", "softmax_cross_entropy", "chain")


def _loop(step, state, steps: int):
    for _ in range(steps):
        state = step(state)
    return state


def _numpy_like(module, name: str) -> SimpleNamespace:
    """NumPy or autograd.numpy under the common names (both already have NumPy's semantics)."""

    def mse(prediction, target):
        difference = prediction - target
        return module.mean(difference * difference)

    def softmax_cross_entropy(logits, labels):
        shifted = logits - module.max(logits, axis=-1, keepdims=True)
        log_probabilities = shifted - module.log(module.sum(module.exp(shifted), axis=-1, keepdims=True))
        rows = logits.shape[0]
        if np.ndim(labels) == 1 and np.issubdtype(np.asarray(labels).dtype, np.integer):
            return -module.mean(log_probabilities[np.arange(rows), labels])
        return -module.sum(labels * log_probabilities) / rows

    return SimpleNamespace(
        name=name,
        dot=module.dot,
        matmul=module.matmul,
        tanh=module.tanh,
        exp=module.exp,
        log=module.log,
        sqrt=module.sqrt,
        sum=module.sum,
        mean=module.mean,
        max=module.max,
        reshape=module.reshape,
        transpose=module.transpose,
        maximum=module.maximum,
        relu=lambda x: module.maximum(x, 0.0),
        where=module.where,
        concatenate=module.concatenate,
        stack=module.stack,
        arange=module.arange,
        mse=mse,
        softmax_cross_entropy=softmax_cross_entropy,
        chain=_loop,
    )


def numpy_namespace() -> SimpleNamespace:
    """Plain NumPy: what hand-written gradients use on CPU (with `ones_like` for seeding them and
    `cosh`, which the seeds' own tanh gradient uses)."""
    namespace = _numpy_like(np, "numpy")
    namespace.ones_like = np.ones_like
    namespace.cosh = np.cosh
    return namespace


def autograd_namespace() -> SimpleNamespace:
    """HIPS autograd's traced NumPy."""
    import autograd.numpy as anp

    return _numpy_like(anp, "autograd.numpy")


def torch_namespace() -> SimpleNamespace:
    """torch ops under NumPy's names and semantics (`axis`/`keepdims`, `dot` of matrices is matmul).

    Also what hand-written gradients use on CUDA, hence `ones_like` and `cosh`.
    """
    import torch

    def reduce(op):
        def reduced(x, axis=None, keepdims=False):
            if axis is None:
                result = op(x)
                return result.reshape((1,) * x.dim()) if keepdims else result
            return op(x, dim=axis, keepdim=keepdims)

        return reduced

    def transpose(x, axes=None):
        return x.permute(*(reversed(range(x.dim())) if axes is None else axes))

    def maximum(a, b):
        if not isinstance(b, torch.Tensor):
            return torch.clamp_min(a, b)
        if not isinstance(a, torch.Tensor):
            return torch.clamp_min(b, a)
        return torch.maximum(a, b)

    def mse(prediction, target):
        difference = prediction - target
        return torch.mean(difference * difference)

    def softmax_cross_entropy(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels.long() if not labels.is_floating_point() else labels)

    return SimpleNamespace(
        name="torch",
        dot=torch.matmul,
        matmul=torch.matmul,
        tanh=torch.tanh,
        exp=torch.exp,
        log=torch.log,
        sqrt=torch.sqrt,
        sum=reduce(torch.sum),
        mean=reduce(torch.mean),
        max=reduce(torch.amax),
        reshape=torch.reshape,
        transpose=transpose,
        maximum=maximum,
        relu=torch.relu,
        where=torch.where,
        concatenate=lambda arrays, axis=0: torch.cat(tuple(arrays), dim=axis),
        stack=lambda arrays, axis=0: torch.stack(tuple(arrays), dim=axis),
        arange=torch.arange,
        mse=mse,
        softmax_cross_entropy=softmax_cross_entropy,
        ones_like=torch.ones_like,
        cosh=torch.cosh,
        chain=_loop,
    )


def checkpoint_segments(steps: int) -> list[int]:
    """The steps of each segment torch-checkpoint cuts a chain of `steps` into: ⌈√steps⌉ segments
    (as torch's docs advise: the boundaries kept plus one segment recomputed is then smallest), of
    lengths that differ by at most one."""
    if steps < 1:
        return []
    count = math.isqrt(steps - 1) + 1
    return [steps // count + (index < steps % count) for index in range(count)]


def describe_segments(steps: int) -> str:
    """The segmentation of a chain of `steps`, in words: what records of torch-checkpoint carry."""
    lengths = checkpoint_segments(steps)
    sizes = "/".join(str(length) for length in sorted(set(lengths), reverse=True))
    return f"{len(lengths)} segments of {sizes} steps (⌈√{steps}⌉), torch.utils.checkpoint, use_reentrant=False"


def segmentation_params(engine: str, steps: int) -> dict:
    """What the records of `engine` on a chain of `steps` say of its segmentation: torch-checkpoint's
    segments in words and their count; nothing for any other engine."""
    if engine not in (TORCH_CHECKPOINT, TORCH_SAC):
        return {}
    return {"checkpoint": describe_segments(steps), "checkpoint_segments": len(checkpoint_segments(steps))}


@functools.cache
def _prime_checkpoint() -> None:
    """One tiny checkpointed gradient, at set-up: torch.utils.checkpoint imports torch._dynamo at its
    first call (some 800 modules, about 77 MB and hundreds of GC passes on CPU), a once-per-process
    cost that would otherwise land in the first measured gradient."""
    import torch
    from torch.utils.checkpoint import checkpoint

    leaf = torch.ones(1, requires_grad=True)
    torch.autograd.grad(checkpoint(torch.exp, leaf, use_reentrant=False).sum(), leaf)


def unknown_aten_ops(names) -> list[str]:
    """The names in `names` that are no op of `torch.ops.aten` (a SAC policy naming them would save nothing). The
    default policy's own ops (aten's in every torch benchlib supports) are not looked up: only a name a user
    gave makes a run's planning import torch."""
    asked = [name for name in names if name not in SAC_SAVED_OPS]
    if not asked:
        return []
    import torch

    return [name for name in asked if not hasattr(torch.ops.aten, name)]


def sac_contexts(saved_ops: tuple[str, ...] = SAC_SAVED_OPS):
    """The contexts of selective activation checkpointing: the outputs of `saved_ops` (aten op names) saved,
    every other op recomputed in backward (by default, `SAC_SAVED_OPS`: pointwise ops, norms, activations
    recomputed, cheap; matrix products, convolutions and attention saved)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {packet for name in saved_ops if (packet := getattr(torch.ops.aten, name, None)) is not None}

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if getattr(op, "overloadpacket", op) in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def torch_checkpoint_namespace(selective: bool = False) -> SimpleNamespace:
    """torch with `chain` cut into `checkpoint_segments`, each under non-reentrant torch.utils.checkpoint:
    only the state between segments is kept, each segment's inside is recomputed during the backward
    pass, as benchlib's "sqrt" policy does on its tape; `selective`: torch-sac's, the outputs of
    `SAC_SAVED_OPS` inside a segment kept too (`sac_contexts`). No RNG state is saved (`chain` steps draw
    no random numbers), and checkpoint's first-call import is paid here (`_prime_checkpoint`)."""
    from torch.utils.checkpoint import checkpoint

    _prime_checkpoint()
    options = {"context_fn": sac_contexts} if selective else {}

    def chain(step, state, steps: int):
        for length in checkpoint_segments(steps):
            state = checkpoint(_loop, step, state, length, use_reentrant=False, preserve_rng_state=False, **options)
        return state

    namespace = torch_namespace()
    namespace.name = "torch (selectively checkpointed chains)" if selective else "torch (checkpointed chains)"
    namespace.chain = chain
    return namespace
