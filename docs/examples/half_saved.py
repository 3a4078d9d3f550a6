"""A model file with a technique of its own: activations saved for backward in float16.

`benchlib run docs/examples/half_saved.py -p engines=torch,half-saved,half-saved+torch-autocast` measures it
beside eager torch and joined with autocast; docs/techniques.md explains each line.
"""

import torch

from benchlib.engines.techniques import Aspect, Technique

NAME = "half_saved_mlp"
PARAMETERS = {"width": 256, "depth": 4, "batch_size": 64}
QUICK = {"width": 32, "depth": 2, "batch_size": 8}


class HalfSaved(Technique):
    """Every float32 activation backward keeps is stored in float16 and restored when backward reads it: half
    the saved bytes, for one rounding of what backward reads."""

    description = "activations saved for backward in float16 (saved-tensor hooks)"
    changes = frozenset({Aspect.SAVING})  # so it joins autocast and micro-batches, never checkpointing
    computes_in = "float16"  # its gradient is judged with float16's tolerance
    hides_saved = "its own saved-tensor hooks take the saved tensors before benchlib's would see them"

    def forward_context(self, step):
        def pack(tensor):
            if tensor.dtype != torch.float32 or isinstance(tensor, torch.nn.Parameter):
                return tensor, None  # parameters are held anyway: a float16 copy would only add to them
            return tensor.to(torch.float16), tensor.dtype

        def unpack(packed):
            tensor, dtype = packed
            return tensor if dtype is None else tensor.to(dtype)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


TECHNIQUES = {"half-saved": HalfSaved}


def model(width, depth, batch_size):
    layers = [torch.nn.Linear(64, width), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def batch(width, depth, batch_size):
    return torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,))


def loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=1e-3)
