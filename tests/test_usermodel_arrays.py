"""The array form of a model file: the ops it may use (their VJPs against torch.autograd, on NumPy and
torch inputs), refusals before anything runs, and a file run end to end under every engine."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from benchlib.autodiff import ACCUMULATE_MODES, grad, ops
from benchlib.engines import namespaces

# (name, benchlib's loss over ops, the same loss in torch): each new op, with broadcasting, ties, repeats.
OP_CASES = [
    ("sqrt", lambda a, b: ops.sum(ops.sqrt(a * a + 1.0) * b), lambda a, b: (torch.sqrt(a * a + 1) * b).sum()),
    ("max axis", lambda a, b: ops.sum(ops.max(a, axis=1) * ops.sum(b, axis=1)),
     lambda a, b: (torch.amax(a, 1) * b.sum(1)).sum()),
    ("max keepdims", lambda a, b: ops.sum(ops.max(a, axis=0, keepdims=True) * b),
     lambda a, b: (torch.amax(a, 0, keepdim=True) * b).sum()),
    ("max all", lambda a, b: ops.max(a * b), lambda a, b: torch.amax(a * b)),
    ("max ties", lambda a, b: ops.sum(ops.max(ops.maximum(a, 0.5), axis=1) * b[:, 0]),
     lambda a, b: (torch.amax(torch.clamp_min(a, 0.5), 1) * b[:, 0]).sum()),
    ("where", lambda a, b: ops.sum(ops.where(a > 0, a * b, b * b)), lambda a, b: torch.where(a > 0, a * b, b * b).sum()),
    ("where scalar", lambda a, b: ops.sum(ops.where(a > b, a, 0.0) * b),
     lambda a, b: (torch.where(a > b, a, 0.0) * b).sum()),
    ("concatenate", lambda a, b: ops.sum(ops.tanh(ops.concatenate([a, b, a], axis=1)) * ops.concatenate([b, a, b], 1)),
     lambda a, b: (torch.tanh(torch.cat([a, b, a], 1)) * torch.cat([b, a, b], 1)).sum()),
    ("stack", lambda a, b: ops.sum(ops.tanh(ops.stack([a, b, a], axis=-1)) * ops.stack([b, b, a], -1)),
     lambda a, b: (torch.tanh(torch.stack([a, b, a], -1)) * torch.stack([b, b, a], -1)).sum()),
    ("index repeated", lambda a, b: ops.sum(a[np.array([0, 2, 0]), 1:] * b[:, :3]),
     lambda a, b: (a[[0, 2, 0], 1:] * b[:, :3]).sum()),
    ("index basic and .T", lambda a, b: ops.sum(a[1] * b[2]) + ops.sum(a.T[0] * a.T[0]),
     lambda a, b: (a[1] * b[2]).sum() + (a.T[0] * a.T[0]).sum()),
    ("index boolean", lambda a, b: ops.sum(a[b > 0] ** 2), lambda a, b: (a[b > 0] ** 2).sum()),
]


def torch_gradient(torch_loss, a, b):
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    grads = torch.autograd.grad(torch_loss(ta, tb), [ta, tb], allow_unused=True)
    return [np.zeros_like(x) if g is None else g.numpy() for g, x in zip(grads, (a, b))]


@pytest.mark.parametrize("mode", ACCUMULATE_MODES)
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize(("name", "loss", "torch_loss"), OP_CASES, ids=[case[0] for case in OP_CASES])
def test_new_ops_vjps_match_torch_autograd(name, loss, torch_loss, library, mode):
    rng = np.random.default_rng(len(name))
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    inputs = (a, b) if library == "numpy" else (torch.tensor(a), torch.tensor(b))
    got = grad(loss, (0, 1), accumulate=mode)(*inputs)
    for g, want in zip(got, torch_gradient(torch_loss, a, b)):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize(("name", "loss", "torch_loss"), OP_CASES[:4], ids=[case[0] for case in OP_CASES[:4]])
def test_new_ops_vjps_match_finite_differences(name, loss, torch_loss):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ga = grad(loss, 0, checkpoint="sqrt")(a, b)
    step, numeric = 1e-6, np.zeros_like(a)
    for index in np.ndindex(a.shape):
        up, down = a.copy(), a.copy()
        up[index] += step
        down[index] -= step
        numeric[index] = (float(loss(up, b)) - float(loss(down, b))) / (2 * step)
    np.testing.assert_allclose(ga, numeric, rtol=1e-5, atol=1e-7)


def test_every_namespace_computes_the_new_ops_alike():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    spaces = {"numpy": namespaces.numpy_namespace(), "autograd": namespaces.autograd_namespace(),
              "torch": namespaces.torch_namespace(), "benchlib": ops}
    calls = [("sqrt", lambda xp, x, y: xp.sqrt(x * x)), ("max", lambda xp, x, y: xp.max(x, axis=1, keepdims=True)),
             ("max", lambda xp, x, y: xp.max(x)), ("where", lambda xp, x, y: xp.where(x > y, x, 0.0)),
             ("concatenate", lambda xp, x, y: xp.concatenate([x, y], axis=-1)),
             ("stack", lambda xp, x, y: xp.stack([x, y], axis=1))]
    for name, call in calls:
        want = call(np, a, b)
        for space_name, xp in spaces.items():
            x, y = (torch.tensor(a), torch.tensor(b)) if space_name == "torch" else (a, b)
            np.testing.assert_allclose(np.asarray(call(xp, x, y)), want, err_msg=f"{name} in {space_name}")
