"""The example model file `benchlib new FILE` writes: the torch form, commented."""

TEMPLATE = '''"""My model, measured by benchlib: `benchlib run THIS_FILE --quick` for a first look.

benchlib builds the model and a batch, then measures one training step (forward, backward and the
optimizer's step) under each engine, each in a fresh process: peak memory, time per step,
allocations and GC pauses, and which role (saved activations, gradients) holds the most.
"""

import torch

NAME = "my_mlp"  # records, files and the report use this name (default: the file's name)

# Every parameter, with its default: `-p width=512` or `--grid width=128,256` change them. Values
# are int, float, bool, str, or a list of one of those; model() and batch() get all of them.
PARAMETERS = {"width": 256, "depth": 4, "batch_size": 64}
QUICK = {"width": 32, "depth": 2, "batch_size": 8}  # what --quick uses: small, for a first look


def model(width, depth, batch_size):
    """The network, freshly initialised (benchlib seeds torch first, so every engine starts alike)."""
    layers = [torch.nn.Linear(784, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def batch(width, depth, batch_size):
    """One batch: a tensor or a tuple of tensors, made on the CPU (benchlib moves them to the device)."""
    return torch.randn(batch_size, 784), torch.randint(0, 10, (batch_size,))


def loss(model, images, labels):
    """A 0-dim tensor: the model, then the batch's tensors in the order batch() returns them."""
    return torch.nn.functional.cross_entropy(model(images), labels)


def optimizer(parameters):
    """Optional. Without it a step is forward and backward only (and fused-optimizer does not apply)."""
    return torch.optim.Adam(parameters, lr=1e-3)
'''
