"""The primitives, with NumPy's names and semantics, on NumPy arrays and torch tensors alike.

Each primitive's VJPs are written once against the backend `xp` of its inputs. Called on plain
arrays (nothing traced) these are ordinary array functions, so a loss written with them runs
unchanged inside and outside `grad`. Operators on traced values (`+ - * / @ **`, unary `-`,
`.T`, indexing) map to the primitives here; comparisons (`< <= > >=`) give plain boolean arrays,
for `where`.

dtype rule: a Python scalar, NumPy scalar or 0-d array combined with arrays takes the arrays'
dtype, so float32 computations stay float32 (and float64 stay float64).
"""

from __future__ import annotations

import builtins
import functools
import math
import operator

import numpy as np

from benchlib.autodiff.core import Primitive, Tracer

__all__ = [
    "add", "subtract", "multiply", "divide", "negative", "power",
    "dot", "matmul", "tanh", "exp", "log", "sum", "mean", "reshape", "transpose",
    "maximum", "relu", "mse", "softmax_cross_entropy", "chain",
    "sqrt", "max", "where", "concatenate", "stack", "arange",
]  # fmt: skip


def arange(*args, **kwargs):
    """NumPy's `arange`: integers to index with (say, each row's label), never differentiated."""
    return np.arange(*args, **kwargs)


def chain(step, state, steps: int):
    """`state = step(state)`, `steps` times: a loop written so that an engine may checkpoint it
    (torch-checkpoint segments it; benchlib's own checkpointing needs no hint and sees a plain loop)."""
    for _ in range(steps):
        state = step(state)
    return state


def _gradient(xp, g, saved):
    return g


def _negated(xp, g, saved):
    return -g


add = Primitive("add", lambda xp, a, b: a + b, (_gradient, _gradient))
subtract = Primitive("subtract", lambda xp, a, b: a - b, (_gradient, _negated))
negative = Primitive("negative", lambda xp, a: -a, (_negated,))
multiply = Primitive(
    "multiply",
    lambda xp, a, b: a * b,
    (lambda xp, g, s: g * s.args[1], lambda xp, g, s: g * s.args[0]),
    save=("inputs",),
)
divide = Primitive(
    "divide",
    lambda xp, a, b: a / b,
    (lambda xp, g, s: g / s.args[1], lambda xp, g, s: -g * s.args[0] / (s.args[1] * s.args[1])),
    save=("inputs",),
)
power = Primitive(
    "power",
    lambda xp, a, b: a**b,
    (
        lambda xp, g, s: g * s.args[1] * s.args[0] ** (s.args[1] - 1),
        # d(a**b)/db = a**b * log(a): defined for a > 0
        lambda xp, g, s: g * s.output * xp.log(s.args[0]),
    ),
    save=("inputs", "output"),
)


def _matmul_vjp_a(xp, g, s):
    a, b = s.args
    if b.ndim == 1:
        return g * b if a.ndim == 1 else xp.expand_dims(g, -1) * b
    if a.ndim == 1:
        return xp.matmul(xp.expand_dims(g, -2), xp.swap_last_two(b))[..., 0, :]
    return xp.matmul(g, xp.swap_last_two(b))


def _matmul_vjp_b(xp, g, s):
    a, b = s.args
    if a.ndim == 1:
        return g * a if b.ndim == 1 else xp.expand_dims(a, -1) * xp.expand_dims(g, -2)
    if b.ndim == 1:
        return xp.matmul(xp.swap_last_two(a), xp.expand_dims(g, -1))[..., 0]
    return xp.matmul(xp.swap_last_two(a), g)


matmul = Primitive("matmul", lambda xp, a, b: xp.matmul(a, b), (_matmul_vjp_a, _matmul_vjp_b), save=("inputs",))


def dot(a, b):
    """NumPy's `dot` for vectors and matrices (the matrix product); use `matmul` for stacks."""
    for name, x in (("a", a), ("b", b)):
        ndim = len(x.shape) if hasattr(x, "shape") else 0
        if ndim not in (1, 2):
            raise ValueError(f"dot takes 1-d or 2-d arrays; {name} has {ndim} dimensions (use matmul or multiply)")
    return matmul(a, b)


tanh = Primitive("tanh", lambda xp, x: xp.tanh(x), (lambda xp, g, s: g * (1 - s.output * s.output),), save=("output",))
exp = Primitive("exp", lambda xp, x: xp.exp(x), (lambda xp, g, s: g * s.output,), save=("output",))
log = Primitive("log", lambda xp, x: xp.log(x), (lambda xp, g, s: g / s.args[0],), save=("inputs",))
sqrt = Primitive("sqrt", lambda xp, x: xp.sqrt(x), (lambda xp, g, s: g / (2 * s.output),), save=("output",))


def _reduced_axes(shape, axis) -> list[int]:
    ndim = len(shape)
    return list(range(ndim)) if axis is None else [a % ndim for a in ((axis,) if isinstance(axis, int) else axis)]


def _kept(xp, value, s):
    """A reduction's result (or its gradient) with the reduced axes kept as 1, as keepdims would have it."""
    if s.kwargs["keepdims"]:
        return value
    shape = s.shapes[0]
    axes = _reduced_axes(shape, s.kwargs["axis"])
    return xp.reshape(value, tuple(1 if i in axes else n for i, n in enumerate(shape)))


def _sum_vjp(xp, g, s):
    """g spread back over the reduced axes."""
    return xp.broadcast_copy(_kept(xp, g, s), s.shapes[0])


def _mean_vjp(xp, g, s):
    shape = s.shapes[0]
    count = math.prod(shape[a] for a in _reduced_axes(shape, s.kwargs["axis"]))
    return _sum_vjp(xp, g / count, s)


_sum = Primitive("sum", lambda xp, x, axis=None, keepdims=False: xp.sum(x, axis, keepdims), (_sum_vjp,))
_mean = Primitive("mean", lambda xp, x, axis=None, keepdims=False: xp.mean(x, axis, keepdims), (_mean_vjp,))


def _max_vjp(xp, g, s):
    """g to the largest entries, shared equally among ties (as torch.amax and HIPS autograd do)."""
    winners = xp.mask(s.args[0] == _kept(xp, s.output, s), g.dtype)
    return winners * (_kept(xp, g, s) / xp.sum(winners, s.kwargs["axis"], True))


_max = Primitive("max", lambda xp, x, axis=None, keepdims=False: xp.amax(x, axis, keepdims), (_max_vjp,),
                 save=("inputs", "output"))


def max(x, axis=None, keepdims=False):  # noqa: A001 - NumPy's name, on purpose
    """Largest entry over `axis` (None: all; int or tuple), as `np.max`."""
    return _max(x, axis=axis, keepdims=keepdims)


def sum(x, axis=None, keepdims=False):  # noqa: A001 - NumPy's name, on purpose
    """Sum over `axis` (None: all; int or tuple), keeping reduced axes as 1 if `keepdims`."""
    return _sum(x, axis=axis, keepdims=keepdims)


def mean(x, axis=None, keepdims=False):
    """Mean over `axis` (None: all; int or tuple), keeping reduced axes as 1 if `keepdims`."""
    return _mean(x, axis=axis, keepdims=keepdims)


_reshape = Primitive(
    "reshape", lambda xp, x, shape: xp.reshape(x, shape), (lambda xp, g, s: xp.reshape(g, s.shapes[0]),)
)


def reshape(x, shape):
    return _reshape(x, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def _transpose_vjp(xp, g, s):
    axes = s.kwargs["axes"]
    ndim = len(s.shapes[0])
    if axes is None:
        return xp.transpose(g)
    inverse = [0] * ndim
    for i, a in enumerate(axes):
        inverse[a % ndim] = i
    return xp.transpose(g, tuple(inverse))


_transpose = Primitive("transpose", lambda xp, x, axes: xp.transpose(x, axes), (_transpose_vjp,))


def transpose(x, axes=None):
    """Permute axes (None: reverse them), as `np.transpose`."""
    return _transpose(x, axes=None if axes is None else tuple(axes))


def _maximum_share(xp, g, mine, other):
    """g where this side is larger, half of it on ties (so both sides together get g)."""
    return g * (xp.mask(mine > other, g.dtype) + 0.5 * xp.mask(mine == other, g.dtype))


maximum = Primitive(
    "maximum",
    lambda xp, a, b: xp.maximum(a, b),
    (
        lambda xp, g, s: _maximum_share(xp, g, s.args[0], s.args[1]),
        lambda xp, g, s: _maximum_share(xp, g, s.args[1], s.args[0]),
    ),
    save=("inputs",),
)
relu = Primitive(
    "relu", lambda xp, x: xp.relu(x), (lambda xp, g, s: g * xp.mask(s.output > 0, g.dtype),), save=("output",)
)


where = Primitive(
    "where",
    lambda xp, condition, a, b: xp.where(condition, a, b),
    (None, lambda xp, g, s: g * xp.mask(s.args[0], g.dtype), lambda xp, g, s: g * (1 - xp.mask(s.args[0], g.dtype))),
    save=("inputs",),
)
where.__doc__ = "`a` where `condition` (a boolean array, e.g. `x > 0`, never differentiated) holds, else `b`."


def _concatenate_vjp(position: int):
    def vjp(xp, g, s):
        axis = s.kwargs["axis"] % len(s.shapes[0])
        start = builtins.sum(shape[axis] for shape in s.shapes[:position])
        return xp.copy(g[(slice(None),) * axis + (slice(start, start + s.shapes[position][axis]),)])

    return vjp


def _stack_vjp(position: int):
    def vjp(xp, g, s):
        return xp.copy(g[(slice(None),) * (s.kwargs["axis"] % (len(s.shapes[0]) + 1)) + (position,)])

    return vjp


@functools.lru_cache(maxsize=None)
def _joining(name: str, count: int) -> Primitive:
    """concatenate or stack of `count` arrays: one VJP per array, so the primitive is made per count."""
    vjp = _concatenate_vjp if name == "concatenate" else _stack_vjp
    return Primitive(name, lambda xp, *arrays, axis: getattr(xp, name)(arrays, axis),
                     tuple(vjp(position) for position in range(count)))


def concatenate(arrays, axis=0):
    """Join arrays along an existing `axis`, as `np.concatenate` (axis=None is not supported)."""
    arrays = tuple(arrays)
    return _joining("concatenate", len(arrays))(*arrays, axis=axis)


def stack(arrays, axis=0):
    """Join arrays along a new `axis`, as `np.stack`."""
    arrays = tuple(arrays)
    return _joining("stack", len(arrays))(*arrays, axis=axis)


def _index_vjp(xp, g, s):
    return xp.index_add(g, s.shapes[0], s.kwargs["index"])


_index = Primitive("getitem", lambda xp, x, index: x[index], (_index_vjp,))


def _getitem(self, index):
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(part, Tracer) for part in parts):
        raise TypeError("an index cannot be a traced (differentiated) array; index with integers, slices or data arrays")
    return _index(self, index=index)


def _mse_forward(xp, prediction, target):
    difference = prediction - target
    return xp.mean(difference * difference)


def _mse_vjp(sign):
    def vjp(xp, g, s):
        difference = s.args[0] - s.args[1]
        return (sign * 2.0 / xp.size(difference)) * g * difference

    return vjp


mse = Primitive("mse", _mse_forward, (_mse_vjp(1.0), _mse_vjp(-1.0)), save=("inputs",))
mse.__doc__ = "Mean squared error, mean((prediction - target)**2), both sides differentiable."


def _targets(xp, logits, labels):
    """Labels as probabilities in the logits' dtype: class indices (N,) become one-hot rows."""
    if not xp.owns(labels):
        raise TypeError(f"labels must be a {xp.name} array like the logits; got {type(labels).__name__}")
    if len(labels.shape) == 1 and xp.is_integer(labels) and labels.shape[0] == logits.shape[0]:
        return xp.one_hot(labels, logits.shape[1], logits.dtype)
    if tuple(labels.shape) == tuple(logits.shape) and xp.is_floating(labels):
        return xp.astype(labels, logits.dtype) if labels.dtype != logits.dtype else labels
    raise ValueError(
        f"labels must be integer class indices of shape ({logits.shape[0]},) or probabilities of "
        f"shape {tuple(logits.shape)}; got {labels.dtype} of shape {tuple(labels.shape)}"
    )


def _log_softmax(xp, logits):
    shifted = logits - xp.amax(logits, axis=-1, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))


def _cross_entropy_forward(xp, logits, labels):
    if len(logits.shape) != 2:
        raise ValueError(f"softmax_cross_entropy takes logits of shape (N, classes); got {tuple(logits.shape)}")
    return -xp.sum(_targets(xp, logits, labels) * _log_softmax(xp, logits)) / logits.shape[0]


def _cross_entropy_vjp(xp, g, s):
    logits, labels = s.args
    return (xp.exp(_log_softmax(xp, logits)) - _targets(xp, logits, labels)) * (g / logits.shape[0])


softmax_cross_entropy = Primitive(
    "softmax_cross_entropy", _cross_entropy_forward, (_cross_entropy_vjp, None), save=("inputs",)
)
softmax_cross_entropy.__doc__ = (
    "Mean over rows of -sum(labels * log_softmax(logits)); labels are class indices (N,) or "
    "probabilities (N, classes) and are not differentiated."
)


def _binary(op, reflected=False):
    if reflected:
        return lambda self, other: op(other, self)
    return lambda self, other: op(self, other)


Tracer.__add__, Tracer.__radd__ = _binary(add), _binary(add, True)
Tracer.__sub__, Tracer.__rsub__ = _binary(subtract), _binary(subtract, True)
Tracer.__mul__, Tracer.__rmul__ = _binary(multiply), _binary(multiply, True)
Tracer.__truediv__, Tracer.__rtruediv__ = _binary(divide), _binary(divide, True)
Tracer.__matmul__, Tracer.__rmatmul__ = _binary(matmul), _binary(matmul, True)
Tracer.__pow__, Tracer.__rpow__ = _binary(power), _binary(power, True)
Tracer.__neg__ = lambda self: negative(self)
Tracer.T = property(lambda self: transpose(self))
Tracer.__getitem__ = _getitem


def _compare(op):
    return lambda self, other: op(self.value, other.value if isinstance(other, Tracer) else other)


Tracer.__lt__, Tracer.__le__ = _compare(operator.lt), _compare(operator.le)
Tracer.__gt__, Tracer.__ge__ = _compare(operator.gt), _compare(operator.ge)
