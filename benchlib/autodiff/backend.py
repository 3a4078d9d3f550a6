"""The array backends: one small set of functions per library, so each VJP is written once.

A backend wraps either NumPy or torch. The engine picks it from the type of the differentiated
inputs and every operation, forward and backward, goes through it; nothing is ever converted
between libraries or moved between devices. torch is imported only when a torch tensor is seen.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext

import numpy as np

SUPPORTED_INPUTS = "NumPy arrays (np.ndarray or NumPy float scalars) and torch tensors of a floating dtype"


def _normalize_axis(axis, ndim: int) -> tuple[int, ...]:
    """`axis` as a tuple of non-negative ints (None means every axis), NumPy's convention."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim if ndim else a for a in axes)


class NumpyBackend:
    """NumPy arrays on the CPU."""

    name = "numpy"

    # --- values and dtypes -------------------------------------------------------------
    def owns(self, value) -> bool:
        return isinstance(value, np.ndarray)

    def normalize(self, value):
        """NumPy returns scalars from 0-d operations; keep arrays so in-place adds stay possible."""
        return value if isinstance(value, np.ndarray) else np.asarray(value)

    def is_floating(self, value) -> bool:
        return np.issubdtype(value.dtype, np.floating)

    def promote(self, dtypes):
        return np.result_type(*dtypes)

    def coerce_scalar(self, constant, dtype):
        """A 0-d constant or Python/NumPy scalar takes the computation's dtype (float32 stays float32)."""
        if isinstance(constant, (bool, int, float, np.generic)) or (
            isinstance(constant, np.ndarray) and constant.ndim == 0
        ):
            return np.asarray(constant, dtype=dtype)
        return constant

    def foreign(self, constant) -> bool:
        """True for an array of another library (would need a conversion: refused)."""
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(constant, torch.Tensor)

    def astype(self, value, dtype):
        return value.astype(dtype)

    def size(self, value) -> int:
        return value.size

    def device(self, value) -> str:
        return "cpu"

    def no_grad(self):
        return nullcontext()

    # --- memory bookkeeping ------------------------------------------------------------
    def storage(self, value) -> tuple[int, int]:
        """(key, nbytes) of the memory block behind `value`; views share their base's key."""
        root = value
        while isinstance(root.base, np.ndarray):
            root = root.base
        return id(root), root.nbytes

    def shares_memory(self, a, b) -> bool:
        return np.may_share_memory(a, b)

    def copy(self, value):
        return value.copy()

    # --- creation and accumulation -----------------------------------------------------
    def ones_like(self, value):
        return np.ones_like(value)

    def zeros_like(self, value):
        return np.zeros_like(value)

    def add(self, a, b):
        return np.asarray(np.add(a, b))  # 0-d + 0-d gives a NumPy scalar, which cannot be added into

    def add_inplace(self, buffer, value):
        np.add(buffer, value, out=buffer)

    def broadcast_copy(self, value, shape):
        """A new, writable array of `shape` (never a stride-0 view handed out as a gradient)."""
        return np.broadcast_to(value, shape).copy()

    # --- primitives --------------------------------------------------------------------
    def matmul(self, a, b):
        return np.matmul(a, b)

    def tanh(self, x):
        return np.tanh(x)

    def exp(self, x):
        return np.exp(x)

    def log(self, x):
        return np.log(x)

    def sum(self, x, axis=None, keepdims=False):
        return np.sum(x, axis=axis, keepdims=keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return np.mean(x, axis=axis, keepdims=keepdims)

    def amax(self, x, axis=None, keepdims=False):
        return np.max(x, axis=axis, keepdims=keepdims)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def transpose(self, x, axes=None):
        return np.transpose(x, axes)

    def swap_last_two(self, x):
        return np.swapaxes(x, -1, -2)

    def expand_dims(self, x, axis):
        return np.expand_dims(x, axis)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def relu(self, x):
        return np.maximum(x, 0)

    def mask(self, condition, dtype):
        return condition.astype(dtype)

    def is_integer(self, value) -> bool:
        return np.issubdtype(value.dtype, np.integer)

    def one_hot(self, labels, classes: int, dtype):
        return np.eye(classes, dtype=dtype)[labels]

    def sqrt(self, x):
        return np.sqrt(x)

    def where(self, condition, a, b):
        return np.where(condition, a, b)

    def concatenate(self, arrays, axis):
        return np.concatenate(arrays, axis)

    def stack(self, arrays, axis):
        return np.stack(arrays, axis)

    def index_add(self, g, shape, index):
        """Zeros of `shape` with `g` added at `index` (an index repeated adds up, as in the forward pass it reads twice)."""
        out = np.zeros(shape, dtype=g.dtype)
        np.add.at(out, index, g)
        return out


class TorchBackend:
    """torch tensors on any device; the backward pass runs under `torch.no_grad()`."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def owns(self, value) -> bool:
        return isinstance(value, self.torch.Tensor)

    def normalize(self, value):
        return value

    def is_floating(self, value) -> bool:
        return value.is_floating_point()

    def promote(self, dtypes):
        result = dtypes[0]
        for dtype in dtypes[1:]:
            result = self.torch.promote_types(result, dtype)
        return result

    def coerce_scalar(self, constant, dtype):
        """0-d tensors take the computation's dtype (on their own device); Python scalars stay
        Python scalars, which torch already treats as weakly typed (no host-to-device copy)."""
        if isinstance(constant, self.torch.Tensor):
            return constant.to(dtype) if constant.dim() == 0 else constant
        if isinstance(constant, np.generic):
            return constant.item()
        return constant

    def foreign(self, constant) -> bool:
        return isinstance(constant, np.ndarray)

    def astype(self, value, dtype):
        return value.to(dtype)

    def size(self, value) -> int:
        return value.numel()

    def device(self, value) -> str:
        return str(value.device)

    def no_grad(self):
        return self.torch.no_grad()

    def storage(self, value) -> tuple[int, int]:
        storage = value.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def shares_memory(self, a, b) -> bool:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def copy(self, value):
        return value.clone()

    def ones_like(self, value):
        return self.torch.ones_like(value)

    def zeros_like(self, value):
        return self.torch.zeros_like(value)

    def add(self, a, b):
        return a + b

    def add_inplace(self, buffer, value):
        buffer.add_(value)

    def broadcast_copy(self, value, shape):
        return value.expand(shape).contiguous()

    def matmul(self, a, b):
        return self.torch.matmul(a, b)

    def tanh(self, x):
        return self.torch.tanh(x)

    def exp(self, x):
        return self.torch.exp(x)

    def log(self, x):
        return math.log(x) if isinstance(x, (int, float)) else self.torch.log(x)

    def _reduce(self, op, x, axis, keepdims):
        axes = _normalize_axis(axis, x.dim())
        if not axes:  # torch reads dim=() as "every axis"; NumPy reads it as "none"
            return x.clone() if axis is not None else op(x)
        return op(x, dim=axes, keepdim=keepdims)

    def sum(self, x, axis=None, keepdims=False):
        return self._reduce(self.torch.sum, x, axis, keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return self._reduce(self.torch.mean, x, axis, keepdims)

    def amax(self, x, axis=None, keepdims=False):
        return self._reduce(self.torch.amax, x, axis, keepdims)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, axes=None):
        return x.permute(tuple(reversed(range(x.dim()))) if axes is None else tuple(axes))

    def swap_last_two(self, x):
        return x.transpose(-1, -2)

    def expand_dims(self, x, axis):
        return x.unsqueeze(axis)

    def maximum(self, a, b):
        if not isinstance(b, self.torch.Tensor):
            return self.torch.clamp_min(a, b)
        if not isinstance(a, self.torch.Tensor):
            return self.torch.clamp_min(b, a)
        return self.torch.maximum(a, b)

    def relu(self, x):
        return self.torch.relu(x)

    def mask(self, condition, dtype):
        return condition.to(dtype)

    def is_integer(self, value) -> bool:
        return not value.is_floating_point() and not value.is_complex() and value.dtype != self.torch.bool

    def one_hot(self, labels, classes: int, dtype):
        return self.torch.nn.functional.one_hot(labels.long(), classes).to(dtype)

    def sqrt(self, x):
        return self.torch.sqrt(x)

    def where(self, condition, a, b):
        return self.torch.where(condition, a, b)

    def concatenate(self, arrays, axis):
        return self.torch.cat(tuple(arrays), dim=axis)

    def stack(self, arrays, axis):
        return self.torch.stack(tuple(arrays), dim=axis)

    def index_add(self, g, shape, index):
        """Zeros of `shape` with `g` added at `index`, repeated positions adding up (any index torch reads)."""
        out = self.torch.zeros(shape, dtype=g.dtype, device=g.device)
        positions = self.torch.arange(out.numel(), device=g.device).reshape(shape)[index]
        out.view(-1).index_add_(0, positions.reshape(-1), g.reshape(-1))
        return out


NUMPY = NumpyBackend()
_torch_backend: TorchBackend | None = None


def backend_of(value):
    """The backend of an array, or None for anything else (Python scalars included)."""
    if isinstance(value, np.ndarray):
        return NUMPY
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        global _torch_backend
        if _torch_backend is None:
            _torch_backend = TorchBackend()
        return _torch_backend
    return None
