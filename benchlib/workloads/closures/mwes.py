"""The two MWEs (dense and reduced), written once against an engine's array namespace."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import CodeType
from typing import Any, Callable

import numpy as np

from benchlib.engines import Engine
from benchlib.workloads.closures.spec import MWE_DTYPES, N_SAMPLES, N_IN, N_OUT, BATCH_SIZE
from benchlib.workloads.closures.engines import ClosureEngine


@dataclass
class ClosureState:
    """What a setup returns (the seed's named tuple), plus the closure's code object."""

    setup: str
    engine: ClosureEngine
    loss: Callable
    code: CodeType
    inputs: tuple
    batches: tuple = ()


@dataclass(frozen=True)
class Dense:
    """Flux's Dense(n_in => n_out): W x .+ b. Parameters are passed in so every engine can differentiate them."""

    xp: Any
    W: Any
    b: Any

    def __call__(self, W, b, x):
        return self.xp.matmul(W, x) + b

    @property
    def params(self) -> tuple:
        return (self.W, self.b)


def mse(xp, prediction, target):
    """Flux.mse: the mean of squared differences."""
    difference = prediction - target
    return xp.mean(difference * difference)


def dense_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """X, Y (uniform in [0, 1), as the seed's rand) and Flux's initial W (Glorot uniform) and b (zeros)."""
    rng = np.random.default_rng(seed)
    dtype = MWE_DTYPES["dense"]
    limit = math.sqrt(6.0 / (N_IN + N_OUT))
    return {
        "X": rng.random((N_IN, N_SAMPLES)).astype(dtype),
        "Y": rng.random((N_OUT, N_SAMPLES)).astype(dtype),
        "W": rng.uniform(-limit, limit, (N_OUT, N_IN)).astype(dtype),
        "b": np.zeros((N_OUT, 1), dtype=dtype),
    }


def reduced_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The seed's X = (1,): one scalar (an Int there, promoted to Float64 by exp), held 0-d."""
    return {"x": np.array(1.0, dtype=MWE_DTYPES["reduced"])}


def _batches(X: np.ndarray, Y: np.ndarray, engine: ClosureEngine) -> tuple:
    """The seed's DataLoader((X, Y), batchsize=2): column blocks, as the engine's arrays."""
    return tuple((engine.asarray(np.ascontiguousarray(X[:, i:i + BATCH_SIZE])),
                  engine.asarray(np.ascontiguousarray(Y[:, i:i + BATCH_SIZE])))
                 for i in range(0, X.shape[1], BATCH_SIZE))


def _dense_state(setup: str, loss: Callable, X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    return ClosureState(setup, engine, engine.wrap_loss(loss), loss.__code__, model.params,
                        _batches(X, Y, engine))


def setup1(X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    """The seed's setup1: a loss closure over `model`, and the data in batches."""
    xp = engine.xp

    def loss(W, b, x, y):
        return mse(xp, model(W, b, x), y)

    return _dense_state("setup1", loss, X, Y, model, engine)


def setup2(X, Y, model: Dense, engine: ClosureEngine) -> ClosureState:
    """setup1 again, written out a second time: the same closure from another code object."""
    xp = engine.xp

    def loss(W, b, x, y):
        return mse(xp, model(W, b, x), y)

    return _dense_state("setup2", loss, X, Y, model, engine)


def train(state: ClosureState) -> list:
    """The seed's train: one gradient of the loss per batch with respect to the model's parameters, collected."""
    grads = []
    W, b = state.inputs
    for x, y in state.batches:
        grads.append(state.engine.gradient(lambda W, b: state.loss(W, b, x, y), (0, 1))(W, b))
    return grads


def splat(f: Callable) -> Callable:
    """Julia's Base.splat: f applied to the elements of one tuple argument."""
    return lambda args: f(*args)


def _reduced_state(setup: str, f: Callable, x, engine: ClosureEngine) -> ClosureState:
    return ClosureState(setup, engine, splat(engine.wrap_loss(f)), f.__code__, (x,))


def reduced_setup1(x, engine: ClosureEngine) -> ClosureState:
    """The reduced setup1: x -> sum(exp(x)), to be splatted over a 1-tuple."""
    xp = engine.xp

    def f(x):
        return xp.sum(xp.exp(x))

    return _reduced_state("setup1", f, x, engine)


def reduced_setup2(x, engine: ClosureEngine) -> ClosureState:
    """reduced_setup1 written out a second time."""
    xp = engine.xp

    def f(x):
        return xp.sum(xp.exp(x))

    return _reduced_state("setup2", f, x, engine)


def reduced_train(state: ClosureState):
    """The reduced train: the gradient of the splatted closure at the 1-tuple (the seed's pullback and back(1))."""
    return state.engine.gradient(lambda x: state.loss((x,)), 0)(*state.inputs)


def reference_gradients(mwe: str, seed: int = 0) -> list:
    """Hand-written float64 gradients of one train() call, per batch: what every engine is checked against."""
    if mwe == "reduced":
        return [np.exp(reduced_arrays(seed)["x"].astype(np.float64))]
    arrays = {k: v.astype(np.float64) for k, v in dense_arrays(seed).items()}
    W, b, X, Y = arrays["W"], arrays["b"], arrays["X"], arrays["Y"]
    grads = []
    for i in range(0, N_SAMPLES, BATCH_SIZE):
        x, y = X[:, i:i + BATCH_SIZE], Y[:, i:i + BATCH_SIZE]
        d_prediction = 2.0 * (W @ x + b - y) / y.size
        grads.append((d_prediction @ x.T, d_prediction.sum(axis=1, keepdims=True)))
    return grads


class MWE:
    """One MWE for one engine: its arrays, its two setups and its train."""

    def __init__(self, mwe: str, engine: ClosureEngine, seed: int = 0):
        self.mwe, self.engine = mwe, engine
        if mwe == "dense":
            arrays = dense_arrays(seed)
            self._X, self._Y = arrays["X"], arrays["Y"]
            self._model = Dense(engine.xp, engine.asarray(arrays["W"]), engine.asarray(arrays["b"]))
            self.train = train
        else:
            self._x = engine.asarray(reduced_arrays(seed)["x"])
            self.train = reduced_train

    def setup(self, name: str) -> ClosureState:
        if self.mwe == "dense":
            return {"setup1": setup1, "setup2": setup2}[name](self._X, self._Y, self._model, self.engine)
        return {"setup1": reduced_setup1, "setup2": reduced_setup2}[name](self._x, self.engine)


def gradients_numpy(grads) -> list[np.ndarray]:
    """Every array of a train() result, flattened to a list of NumPy arrays."""
    if isinstance(grads, (list, tuple)):
        return [array for item in grads for array in gradients_numpy(item)]
    return [Engine.to_numpy(grads)]


def identical(grads_a, grads_b) -> bool:
    """Bit-for-bit equality, as the seed's `train(state1) == train(state2)`."""
    a, b = gradients_numpy(grads_a), gradients_numpy(grads_b)
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


