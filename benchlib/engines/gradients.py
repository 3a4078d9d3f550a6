"""An engine's gradient against the hand-written one: saved by the case's child without pickle,
compared in the parent relative to the largest entry, within a tolerance per dtype."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from benchlib.engines import Engine
from benchlib.engine_names import MANUAL
from benchlib.records.metrics import GRAD_ERROR_METRIC
# max|g - g_manual| / max|g_manual| an engine's gradient may reach. Reordered sums of hundreds of
# contributions cost thousands of float32 rounding errors where they cancel (the RNN's bias
# gradients at T=200 reach 7e-5); a wrong gradient is off by far more than either bound.
GRADIENT_TOLERANCE = {"float32": 1e-3, "float64": 1e-10}
# Model files may train in half precision: 8 (bfloat16) or 11 (float16) bits of mantissa.
HALF_PRECISION_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2}
# A reference's check sets it (1) when its own gradient changes with the random seed: the step draws
# random numbers (dropout), so another engine's gradient equals it only if it draws the same ones.
SEED_DEPENDENT_METRIC = "grad_seed_dependent"


# At half precision a gradient must also lose no array: rounding that is small beside the largest array can swamp
# a small one whole (the seed RNN's output weights under autocast: 0 where eager's are 3% of the largest entry),
# which one error relative to the largest entry reads as agreement. Each array's error, relative to its own largest
# entry or to what the dtype resolves beside the largest of all (its unit roundoff's share), whichever is larger,
# must stay within LOST_ARRAY; an array below that share (a bias BatchNorm cancels: 1e-6 of the largest) is
# judged against the share, not against its own rounding-sized scale.
WORST_ARRAY_METRIC = "grad_worst_array_rel_err"
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
LOST_ARRAY = 0.5  # half of an array's gradient gone: lost, not rounded


def error_limit(metric: str, dtype: str) -> float | None:
    """The most a gradient check's `metric` may read for a gradient computed in `dtype`: the dtype's tolerance,
    or `LOST_ARRAY` for the array-by-array check (None: a dtype without a tolerance, recorded, not judged)."""
    tolerance = gradient_tolerance(dtype)
    return LOST_ARRAY if metric == WORST_ARRAY_METRIC and tolerance is not None else tolerance


def array_floor(dtype: str) -> float | None:
    """The `floor` of the array-by-array check a gradient computed in `dtype` also gets (`max_relative_error`):
    its unit roundoff at half precision; None for float32 and float64, whose rounding stays far below the
    tolerance in every array."""
    return UNIT_ROUNDOFF.get(dtype)


def gradient_tolerance(dtype: str) -> float | None:
    """The largest `max_relative_error` a gradient in `dtype` may have and still be the same maths, or None
    for a dtype without one (its error is recorded, not judged)."""
    return GRADIENT_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE.get(dtype))


def _leaves(gradient) -> list:
    return list(gradient) if isinstance(gradient, (tuple, list)) else [gradient]


def _as_float64(array) -> np.ndarray:
    return np.asarray(Engine.to_numpy(array), dtype=np.float64)


UPDATE_ERROR_METRIC = "update_max_rel_err"


class NonFiniteGradient(ValueError):
    """A gradient holding NaN or inf: the step did not compute a usable gradient (a NaN loss, an overflow)."""


def require_finite(gradient, names=None) -> None:
    """Raise `NonFiniteGradient` naming the arrays (by `names`, else their index) that hold NaN or inf."""
    leaves = _leaves(gradient)
    bad = [str(names[index]) if names is not None else f"array {index}"
           for index, leaf in enumerate(leaves) if not np.all(np.isfinite(_as_float64(leaf)))]
    if bad:
        raise NonFiniteGradient(f"the gradient holds NaN or inf (in {', '.join(bad[:5])}"
                                f"{' ...' if len(bad) > 5 else ''}): the loss is not finite at these values, or overflows")


def gradient_file(directory: str | os.PathLike, engine: str) -> Path:
    """Where `engine`'s gradient is saved in `directory`."""
    return Path(directory) / f"{engine}.npz"


def save_gradient(gradient, directory: str | os.PathLike, engine: str) -> None:
    """Save a gradient (one array or a tuple of them, NumPy or torch) as `<engine>.npz`, no pickle.

    Called by a case's check in the isolation child, after the measurement.
    """
    arrays = {f"g{index}": Engine.to_numpy(leaf) for index, leaf in enumerate(_leaves(gradient))}
    np.savez(gradient_file(directory, engine), **arrays)


def load_gradient(directory: str | os.PathLike, engine: str) -> list[np.ndarray]:
    """The arrays `save_gradient` saved for `engine`, in order."""
    path = gradient_file(directory, engine)
    if not path.is_file():
        raise FileNotFoundError(f"no gradient saved for {engine!r} ({path}): the case's check must call "
                                "benchlib.engines.gradients.save_gradient(result, gradient_dir, engine)")
    with np.load(path, allow_pickle=False) as saved:
        return [saved[f"g{index}"] for index in range(len(saved.files))]


def saved_gradient_error(directory: str | os.PathLike, engine: str, reference: str = MANUAL,
                         floor: float | None = None) -> float:
    """`max_relative_error` of `engine`'s saved gradient against `reference`'s."""
    return max_relative_error(load_gradient(directory, engine), load_gradient(directory, reference), floor=floor)


def max_relative_error(gradient, reference, floor: float | None = None) -> float:
    """max |g - ref| / max |ref| over all arrays of a gradient (one array or a tuple of them); with `floor`
    (`array_floor`), the worst array's, each relative to max(its own largest entry, floor x the largest of all).

    Relative to the largest entry, not entry by entry: entries near zero would otherwise turn
    rounding noise into huge ratios. NaN anywhere gives NaN (a failed check, never a pass).
    """
    got, want = _leaves(gradient), _leaves(reference)
    if len(got) != len(want):
        raise ValueError(f"gradient has {len(got)} arrays, the reference {len(want)}")
    got, want = [_as_float64(g) for g in got], [_as_float64(w) for w in want]
    for index, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            raise ValueError(f"gradient array {index} has shape {g.shape}, the reference {w.shape}")
    largest = _largest(want)
    if floor is None:
        return _relative_error(got, want, largest)
    return max((_relative_error([g], [w], max(_largest([w]), floor * largest)) for g, w in zip(got, want)),
               default=0.0, key=lambda error: math.inf if math.isnan(error) else error)


def _largest(arrays: list[np.ndarray]) -> float:
    return max((float(np.max(np.abs(a))) for a in arrays if a.size), default=0.0)


def _relative_error(got: list[np.ndarray], want: list[np.ndarray], scale: float) -> float:
    error = max(float(np.max(np.abs(g - w))) if w.size else 0.0 for g, w in zip(got, want))
    if not (math.isfinite(scale) and math.isfinite(error)):
        return math.nan
    return error / scale if scale > 0 else error
