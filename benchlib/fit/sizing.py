"""Size models: a step's total memory as a function of one integer parameter, each checked on the point it
did not see, and the largest value each says is under a limit (`benchlib.fit.search`).

Two models come from measured points alone: linear in the parameter (a batch) and quadratic (attention over a
sequence length). Each is fitted to the smaller points and judged by how well it predicts the largest measured
one, so the model is checked, not assumed. A third, the trace model, starts from the step's live tensor bytes
traced under fake tensors (`benchlib.fit.tracing`) at the measured values and at `TRACE_REACH` times the
largest, and maps them onto the measured totals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from benchlib.fit.search import largest_under

MIN_POINTS = 3  # a model checked on a held-out point needs two to fit and one to predict
LINEAR, QUADRATIC, TRACE = "linear", "quadratic", "trace"
TRACE_REACH = (2, 4, 8)  # traced beyond the largest measured value, at these multiples of it
TRACE_TRUSTED = 0.05  # a trace model that predicts the largest measured point this well is chosen
GROWTH_RESOLUTION = 0.05  # a total must rise by this share over the measured values for its slope to be read: fresh
# processes' totals of one step differ by up to 2.4%, so a smaller rise is noise (a slope that can even turn negative)


def grows(points: Sequence[tuple[int, int]]) -> bool:
    """Whether the totals measured at these (value, total) points rise measurably: the fitted line's rise over them
    exceeds `GROWTH_RESOLUTION` of their median total."""
    x = np.array([value for value, _ in points], float)
    y = np.array([total for _, total in points], float)
    if x.size < 2 or np.ptp(x) == 0:
        return False
    slope = np.polyfit(x, y, 1)[0]
    return slope * np.ptp(x) > GROWTH_RESOLUTION * float(np.median(y))


@dataclass(frozen=True)
class SizeModel:
    """total(v) as a polynomial in v (`coefficients`, highest power first, np.polyval's order), chosen by
    `check_error`: the relative error with which, fitted to the other points, it predicted the largest."""

    kind: str
    coefficients: tuple[float, ...]
    check_error: float

    def __call__(self, value: float) -> float:
        return float(np.polyval(self.coefficients, value))

    def bounds(self, value: float) -> tuple[float, float]:
        """The interval around the prediction at `value`: its own out-of-sample error either side."""
        predicted, error = self(value), max(self.check_error, 0.0)
        return predicted * (1 - error), predicted * (1 + error)

    def largest_under(self, limit: float, start: int) -> int | None:
        """The largest integer v >= `start` whose predicted total is at most `limit` (None when not even
        `start`; `SEARCH_LIMIT` when the total does not reach the limit there)."""
        return largest_under(self, limit, {start: self(start)})


def choose_model(values: Sequence[float], totals: Sequence[float]) -> SizeModel:
    """The size model of one engine: linear, or quadratic where it predicts the largest point better from
    the others (four points or more) and does not turn down (memory that shrinks as the value grows is a fit
    to noise, and would say any value fits). Refitted to every point once chosen."""
    x, y = np.asarray(values, float), np.asarray(totals, float)
    if x.size < MIN_POINTS:
        raise ValueError(f"a size model needs {MIN_POINTS} measured points, got {x.size}")
    order = np.argsort(x)
    x, y = x[order], y[order]
    candidates = [(LINEAR, 1)] + ([(QUADRATIC, 2)] if x.size >= 4 else [])
    errors = {}
    for kind, degree in candidates:
        if degree == 2 and np.polyfit(x, y, 2)[0] < 0:  # a parabola that turns down says memory will shrink
            continue
        predicted = float(np.polyval(np.polyfit(x[:-1], y[:-1], degree), x[-1]))
        errors[kind] = abs(predicted - y[-1]) / y[-1] if y[-1] else math.inf
    kind = min(errors, key=errors.get)
    degree = dict(candidates)[kind]
    return SizeModel(kind, tuple(float(c) for c in np.polyfit(x, y, degree)), errors[kind])


def trace_values(points: Sequence[tuple[int, int]]) -> list[int]:
    """The values `trace_model` traces: the measured ones and `TRACE_REACH` times the largest."""
    largest = max(value for value, _ in points)
    return sorted({value for value, _ in points} | {largest * k for k in TRACE_REACH})


def trace_model(points: Sequence[tuple[int, int]], trace: Callable[[int], int]) -> tuple[SizeModel, dict[int, int]]:
    """The trace size model of measured (value, total) points: the traced peaks at the measured values and at
    `TRACE_REACH` times the largest, as a polynomial (linear, or quadratic where that predicts the farthest
    traced value better), mapped onto the measured totals by `_offset` or `_affine`, whichever, fitted to the
    smaller points, predicts the largest measured total better (its error is the check's). Also every traced
    peak, by value."""
    measured = sorted(points)
    traced = {value: trace(value) for value in trace_values(measured)}
    x, y = np.array(list(traced), float), np.array(list(traced.values()), float)
    errors = {degree: abs(np.polyval(np.polyfit(x[:-1], y[:-1], degree), x[-1]) - y[-1]) / max(y[-1], 1.0)
              for degree in (1, 2)}
    curve = np.polyfit(x, y, 1 if errors[1] <= errors[2] else 2)
    peaks = np.array([traced[value] for value, _ in measured], float)
    totals = np.array([total for _, total in measured], float)
    checked = {}
    for mapping in (_offset, _affine):
        scale, offset = mapping(peaks[:-1], totals[:-1])
        checked[mapping] = abs(scale * peaks[-1] + offset - totals[-1]) / totals[-1]
    mapping = min(checked, key=checked.get)  # the one that predicted the largest measured total better
    check_error = checked[mapping]
    scale, offset = mapping(peaks, totals)
    coefficients = scale * np.array(curve, float)
    coefficients[-1] += offset
    return SizeModel(TRACE, tuple(float(c) for c in coefficients), check_error), traced


def _offset(peaks: np.ndarray, totals: np.ndarray) -> tuple[float, float]:
    """(1, offset): total = traced peak + what does not grow (the interpreter, torch), the median difference."""
    return 1.0, float(np.median(totals - peaks))


def _affine(peaks: np.ndarray, totals: np.ndarray) -> tuple[float, float]:
    """(scale, offset) of total = scale * traced peak + offset by least squares: the scale is what the allocator adds
    per byte of tensors besides. Peaks that do not grow give `_offset`'s."""
    if np.ptp(peaks) == 0:
        return _offset(peaks, totals)
    scale, offset = np.polyfit(peaks, totals, 1)
    return float(scale), float(offset)
