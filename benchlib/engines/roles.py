"""Where an engine's peak goes, by role: forward values saved for the backward pass, gradient
buffers, and the rest (the measured peak minus both).

benchlib's engines know both roles exactly from their tape, at the instant of their largest sum.
torch engines show their saved tensors through `torch.autograd.graph.saved_tensors_hooks`: the
bytes of the distinct storages autograd packed during one call, inputs excluded (the caller's),
which is what they hold when the forward pass ends; their gradient buffers stay in "other".
Hand-written gradients and HIPS autograd expose neither, so their whole peak is "other".
"""

from __future__ import annotations

from typing import Any, Callable

SAVED_METRIC = "role_saved_bytes"
GRADIENT_METRIC = "role_gradient_bytes"


def memory_roles(engine, gradient: Callable, call: Callable[[], Any], inputs: tuple = ()) -> dict[str, float]:
    """The role metrics of `engine` (an `Engine`) for the gradient function it built: from the tape
    of its last call, or, for torch engines, from one more `call()` under saved-tensor hooks."""
    stats = getattr(gradient, "stats", None)
    if stats is not None:
        return {SAVED_METRIC: float(stats.saved_bytes_at_peak_total),
                GRADIENT_METRIC: float(stats.live_bytes_at_peak_total)}
    if engine.name.startswith("torch"):
        return {SAVED_METRIC: float(torch_saved_bytes(call, inputs))}
    return {}


def torch_saved_bytes(call: Callable[[], Any], inputs: tuple = ()) -> int:
    """Bytes of the distinct storages torch autograd saves for backward during `call()`, not
    counting the storages of `inputs` (views of one storage count once)."""
    import torch

    seen = {tensor.untyped_storage().data_ptr() for tensor in inputs}
    total = 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return total
