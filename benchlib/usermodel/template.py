"""The example model files `benchlib new FILE` writes, commented: the torch form, or the array
form (`--form arrays`); and a model file written from a user's own functions (`write_model_file`)."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchlib.errors import Refused

FUNCTIONS = ("model", "batch", "loss", "optimizer", "step")
VALUES = ("NAME", "PARAMETERS", "QUICK")

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


# Optional: your whole training step, measured as written by torch and torch-checkpoint (torch.func and
# fused-optimizer cannot run your own backward and optimizer calls, and say so). Uncomment to use it:
# def step(model, optimizer, images, labels):
#     optimizer.zero_grad()
#     loss(model, images, labels).backward()
#     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
#     optimizer.step()
'''

ARRAY_TEMPLATE = '''"""My model in the array form, measured by benchlib: `benchlib run THIS_FILE --quick` for a first look.

params() are the arrays differentiated, data() the inputs; loss(xp, ...) is written once against
`xp`, the NumPy-like namespace each engine hands it (benchlib's own engines, HIPS autograd, torch,
torch.func), so the same file runs under every one. benchlib measures one gradient of the loss with
respect to every params array under each engine, each in a fresh process: peak memory, time,
allocations, GC pauses, and the gradient's error against torch's.
"""

import numpy as np

NAME = "my_regression"  # records, files and the report use this name (default: the file's name)

# Every parameter, with its default: `-p width=512` or `--grid width=128,256` change them. Values
# are int, float, bool, str, or a list of one of those; params() and data() get all of them.
PARAMETERS = {"width": 256, "features": 64, "batch_size": 128}
QUICK = {"width": 16, "features": 8, "batch_size": 4}  # what --quick uses: small, for a first look


def params(width, features, batch_size):
    """The arrays to differentiate: a tuple of NumPy arrays of one dtype, float32 or float64
    (benchlib seeds np.random first, so every engine starts from the same values)."""
    W1 = np.random.standard_normal((features, width)) / np.sqrt(features)
    W2 = np.random.standard_normal((width, 1)) / np.sqrt(width)
    return W1.astype(np.float32), np.zeros(width, np.float32), W2.astype(np.float32), np.zeros(1, np.float32)


def data(width, features, batch_size):
    """The inputs, not differentiated: a tuple of NumPy arrays (integer arrays are fine too)."""
    x = np.random.standard_normal((batch_size, features)).astype(np.float32)
    return x, np.sin(x.sum(axis=1, keepdims=True))


def loss(xp, W1, b1, W2, b2, x, y):
    """A scalar: xp first, then params' arrays, then data's, in the order they return them. Use xp's
    ops (tanh exp log sqrt sum mean max maximum where matmul dot reshape transpose concatenate stack
    relu mse softmax_cross_entropy chain; docs/engines.md) and operators (+ - * / ** @, unary -,
    indexing, .T, comparisons for where); never float() or .item(), which no engine differentiates."""
    hidden = xp.tanh(x @ W1 + b1)
    prediction = hidden @ W2 + b2
    return xp.mean((prediction - y) ** 2)
'''


def write_model_file(form: Mapping[str, Any], folder: str | Path) -> Path:
    """The torch form's functions and values (`model`, `batch`, `loss`, optional `optimizer` and `step`, `NAME`,
    `PARAMETERS`, `QUICK`) as a model file in `folder`: each function by its source, so it may use only
    torch and its arguments (the measured children import the file, not this process's objects)."""
    unknown = sorted(set(form) - {*FUNCTIONS, *VALUES})
    if unknown:
        raise Refused(f"profile() takes a path or a mapping of {', '.join(FUNCTIONS + VALUES)}; got {unknown}")
    parts = ["import torch\n"]
    parts += [f"{name} = {form[name]!r}\n" for name in VALUES if name in form]
    parts += [textwrap.dedent(inspect.getsource(form[name])) for name in FUNCTIONS if form.get(name) is not None]
    path = Path(folder) / f"{form.get('NAME', 'model')}.py"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
