"""benchlib's reverse-mode engine: gradients on NumPy arrays and torch tensors (any device),
with in-place or deferred gradient accumulation and exact counters of live gradient bytes.

    from benchlib.autodiff import grad, ops
    df = grad(lambda x, z: ops.sum(ops.tanh(x @ z)), argnum=0, accumulate="inplace")
    gx = df(x, z)
    df.stats.peak_bytes          # BackwardStats of that call

See docs/autodiff.md. Higher-order gradients are not supported.
"""

from benchlib.autodiff import ops
from benchlib.autodiff.core import (
    ACCUMULATE_MODES,
    BackwardStats,
    GradientFunction,
    Primitive,
    Tracer,
    grad,
    value_and_grad,
)

__all__ = [
    "ACCUMULATE_MODES",
    "BackwardStats",
    "GradientFunction",
    "Primitive",
    "Tracer",
    "grad",
    "ops",
    "value_and_grad",
]
