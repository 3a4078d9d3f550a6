"""`benchlib fit`: the largest value of an integer parameter (a batch size, a sequence length) at which a
model file's step fits a memory limit, under each engine, predicted and checked.

Each engine's step is measured at a few values of the parameter (an eighth, a quarter, a half and all of
the value it is given), one fresh process each. Its total memory is then fitted by a size model. Two
models are tried: linear in the parameter (a batch) and quadratic (attention over a sequence length).
Each is fitted to the smaller points and judged by how well it predicts the largest measured one, so the
model is checked, not assumed. A third, where torch can trace the step under fake tensors (no memory
taken, `traced_peak`), counts the step's live tensor bytes exactly at the measured values and at 2, 4 and
8 times the largest: its total is that curve plus a constant (the interpreter, torch), or scaled as well (what
the allocator adds per byte of tensors), whichever predicts the largest measured total better from the
others; it is chosen whenever that prediction is within `TRACE_TRUSTED`. The chosen model, refitted to every point, says where the total crosses the limit. `verify` measures the best engine at that value when the machine has the memory, and reports
predicted against measured.

Total memory, defined once: on CUDA the caching allocator's reserved peak (`cuda_reserved_peak_bytes`),
which is what an out-of-memory error is about; on the CPU the step process's resident high-water mark
(its resident memory before the step plus the step's peak above it), which includes the interpreter and
torch, since those must fit too.

On a machine without a GPU, `device="cuda"` predicts instead of measuring (`predict_fit`): each engine's
reserved peak from its step traced under fake tensors and replayed through a model of the caching
allocator (`benchlib.usermodel.cuda_prediction`), at the same values and at `TRACE_REACH` times the given
one, the largest fitting value found by bisection over traces, and every line, record and figure says
"predicted, not measured on a GPU".
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchlib.records.metrics import CUDA_RESERVED_PEAK, METRICS
from benchlib.units import format_bytes, format_seconds

FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)  # of the parameter's given value: the points measured
MIN_POINTS = 3  # a model checked on a held-out point needs two to fit and one to predict
WARMUP, STEPS = 1, 3
LINEAR, QUADRATIC, TRACE = "linear", "quadratic", "trace"
TRACE_REACH = (2, 4, 8)  # traced beyond the largest measured value, at these multiples of it
TRACE_TRUSTED = 0.05  # a trace model that predicts the largest measured point this well is chosen
# A training process runs with the allocator the user's environment gives it, not the fixed mmap threshold `run`
# measures peaks under (which returns freed buffers at once): glibc keeps freed heap, so the same step's resident
# high-water is higher. Measured under benchlib's policy, a small ViT's eager step at batch 256 read 900 MB where a
# lean process of its own reached 1077 MB: answers overshot the limit by that much.
USERS_ALLOCATOR = "glibc-default"
REACH = 2  # no answer on a device that can hold the limit lies more than this many times past a measured value
SEARCH_LIMIT = 2 ** 40  # the largest value `max_fitting` looks at: a total that does not grow fits "at any value"
FIT_METRICS = (  # what a fit records: a command's, not a benchmark's, so registered where it is made
    ("fit_total_bytes", "B", "memory", "total memory of one step at params.value of the parameter params.scale: on CUDA "
     "the allocator's reserved peak, on the CPU the process's resident high-water mark (params.total says which)"),
    ("predicted_total_bytes", "B", "memory", "the size model's total at params.value (params.model: linear or quadratic)"),
    ("fit_check_error", "ratio", "check", "relative error of the size model, fitted to the smaller points, at the "
     "largest measured one: how far its extrapolation was off where it could be checked"),
    ("traced_peak_bytes", "B", "memory", "the step's peak of live tensor bytes at params.value, traced under fake "
     "tensors (no memory taken): what the trace model adds its constant to"),
    ("max_fitting", "", "setting", "the largest value of params.scale whose predicted total stays under params.limit "
     "bytes (0: not even the smallest value measured)"),
    ("true_max_fitting", "", "check", "the largest value of params.scale whose measured total stays under params.limit, "
     "searched by measurement from the predicted one (params.predicted; params.searched: value -> total measured)"),
    ("fit_verify_error", "ratio", "check", "(predicted - measured) / measured total at the largest fitting value, "
     "measured for real (`benchlib fit --verify`; params.predicted, params.measured)"),
)
for _metric in FIT_METRICS:
    METRICS.register(*_metric)


@dataclass(frozen=True)
class MemoryLimit:
    """A limit with headroom: `size` ("24 GiB", bytes) of which `margin` (a fraction) is kept free."""

    size: Any
    margin: float = 0.0


class FitError(ValueError):
    """A fit that cannot be asked as written (an unknown or non-integer parameter, a value too small to
    measure at three points, a size that does not parse): refused before anything is measured."""


@dataclass(frozen=True)
class SizeModel:
    """total(v) as a polynomial in v (`coefficients`, highest power first, np.polyval's order), chosen by
    `check_error`: the relative error with which, fitted to the other points, it predicted the largest."""

    kind: str
    coefficients: tuple[float, ...]
    check_error: float

    def __call__(self, value: float) -> float:
        return float(np.polyval(self.coefficients, value))

    def largest_under(self, limit: float, start: int) -> int | None:
        """The largest integer v >= `start` whose predicted total is at most `limit` (None when not even
        `start`; `SEARCH_LIMIT` when the total does not reach the limit there)."""
        if self(start) > limit:
            return None
        low, high = start, start
        while high < SEARCH_LIMIT and self(high) <= limit:
            low, high = high, high * 2
        if self(high) <= limit:
            return SEARCH_LIMIT
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self(middle) <= limit else (low, middle)
        return low


def traced_peak(model_file, engine: str, values: Mapping[str, Any]) -> int:
    """The peak of live tensor bytes of one `engine` step at `values` (the optimizer's state made by a step
    before it, as in a measured process), traced under fake tensors, so any value can be asked without its
    memory; by `torch.distributed._tools.mem_tracker.MemTracker`, torch's own (private) tracker. Raises where
    torch cannot trace the step (a batch that is not fake, data-dependent control flow, torch.func's wrappers).
    Arrays the file makes outside torch (numpy) are real: `trace_model` asks at most `TRACE_REACH[-1]` times
    the largest value measured, whose batch a measured process held in full."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def batch_is_fake(batch: tuple) -> None:
        real = [i for i, tensor in enumerate(batch) if not isinstance(tensor, FakeTensor)]
        if real:
            raise FitError(f"batch() item(s) {real} are real tensors under fake tensor mode")

    with FakeTensorMode():
        return tracked_peak(model_file, engine, values, batch_is_fake)


def tracked_peak(model_file, engine: str, values: Mapping[str, Any], check_batch: Callable[[tuple], None] = tuple) -> int:
    """The peak of live tensor bytes of one `engine` step at `values` by torch's `MemTracker`, after one step that
    makes the optimizer's state: under fake tensors (`traced_peak`) or, as a test compares, real ones."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchlib.usermodel.case import make_step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracker's own, about tensors it skips (None gradients)
        model, batch = model_file.build(values)  # on the CPU: moving fake parameters is refused; bytes are the same
        check_batch(batch)
        step = make_step(model_file, engine, model, batch)
        step()
        tracker = MemTracker()
        tracker.track_external(model, *step.optimizers)
        with tracker:
            step()
        (categories,) = tracker.get_tracker_snapshot("peak").values()
    return int(categories["Total"])


def trace_model(points: Sequence[tuple[int, int]], trace: Callable[[int], int]) -> tuple[SizeModel, dict[int, int]]:
    """The trace size model of measured (value, total) points: the traced peaks at the measured values and at
    `TRACE_REACH` times the largest, as a polynomial (linear, or quadratic where that predicts the farthest
    traced value better), mapped onto the measured totals by `_offset` or `_affine`, whichever, fitted to the
    smaller points, predicts the largest measured total better (its error is the check's). Also every traced
    peak, by value."""
    measured = sorted(points)
    largest = measured[-1][0]
    traced = {value: trace(value) for value in sorted({v for v, _ in measured} | {largest * k for k in TRACE_REACH})}
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


def choose_model(values: Sequence[float], totals: Sequence[float]) -> SizeModel:
    """The size model of one engine: linear, or quadratic where it predicts the largest point better from
    the others (four points or more) and does not turn down (memory that shrinks as the value grows is a fit
    to noise, and would say any value fits). Refitted to every point once chosen."""
    x, y = np.asarray(values, float), np.asarray(totals, float)
    if x.size < MIN_POINTS:
        raise FitError(f"a size model needs {MIN_POINTS} measured points, got {x.size}")
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


@dataclass
class EngineFit:
    """One engine: its measured points (value, total bytes, seconds per step), its size model, and the
    largest value predicted to fit; `reason` where it could not be fitted (not applicable, failed)."""

    engine: str
    points: list[tuple[int, int, float]] = field(default_factory=list)
    model: SizeModel | None = None
    max_fitting: int | None = None
    reason: str = ""
    traced: dict[int, int] = field(default_factory=dict)  # value -> traced peak bytes, where the step was traced
    untraced: str = ""  # why it was not
    unmeasured: str = ""  # why the points stop short of the answer (the machine cannot hold the next one), if they do

    @property
    def extrapolation(self) -> float:
        """How far past the largest measured value the answer lies (1: at or below it)."""
        largest = max((value for value, _, _ in self.points), default=0)
        if self.max_fitting is None or not largest or self.max_fitting >= SEARCH_LIMIT:
            return math.nan
        return max(1.0, self.max_fitting / largest)

    def answer(self, limit: float) -> int | None:
        """The largest value whose predicted total, raised by the size model's own out-of-sample error (its upper
        bound), stays under `limit`, and never below a measured value whose measured total does; None when no
        measured total is under it."""
        under = [value for value, total, _ in self.points if total <= limit]
        if not under:
            return None
        start = min(value for value, _, _ in self.points)
        predicted = self.model.largest_under(limit / (1 + max(self.model.check_error, 0.0)), start)
        return max(predicted or 0, max(under))

    def seconds_per_sample(self, value: int) -> tuple[float, str]:
        """Time per step over the value, measured at the largest measured value at or below `value` (per-sample
        time falls as the value grows, so beyond the points this is an upper bound, and the label says where);
        NaN where nothing was measured (a prediction without a GPU)."""
        if not self.points:
            return math.nan, "not measured"
        at = max((point for point in self.points if point[0] <= value), default=self.points[0])
        return at[2] / at[0], "measured" if at[0] == value else f"measured at {at[0]}"


@dataclass
class FitResult:
    """`fit`'s answer: every engine's fit, the best (the largest value, then the least time per sample),
    and, with `verify`, the best engine measured at its value."""

    name: str
    scale: str
    limit: int
    device: str
    total: str
    engines: list[EngineFit]
    verified: dict | None = None
    basis: str = "measured"  # or cuda_prediction.BASIS: the totals are predicted, nothing ran on the device
    unseen: list[str] = field(default_factory=list)  # predicted: what CUDA's kernels take that the trace did not see
    margin: float = 0.0  # the share of the limit kept free: answers stay under limit * (1 - margin)

    @property
    def usable(self) -> float:
        return self.limit * (1.0 - self.margin)

    @property
    def fitted(self) -> list[EngineFit]:
        return [fit for fit in self.engines if fit.max_fitting is not None]

    @property
    def predicted(self) -> bool:
        return self.basis != "measured"

    @property
    def best(self) -> EngineFit | None:
        """The largest value; then the least time per sample, or, predicted, the least total there."""
        def rank(fit: EngineFit) -> tuple:
            seconds = fit.seconds_per_sample(fit.max_fitting)[0]
            return fit.max_fitting, -(0.0 if math.isnan(seconds) else seconds), -fit.model(fit.max_fitting)

        return max(self.fitted, key=rank, default=None)

    def lines(self) -> list[str]:
        """The answer first, measured or predicted, then one line per engine, then the verification."""
        limit = format_bytes(self.limit) + (f" less a {100 * self.margin:g}% margin ({format_bytes(int(self.usable))})"
                                            if self.margin else "")
        best = self.best
        if not any(fit.model is not None for fit in self.engines):
            lines = [f"{self.name}: no engine could be {'predicted' if self.predicted else 'measured'}; each says why"]
        elif best is None:
            lines = [f"{self.name}: no engine fits {limit} ({self.total}) even at the smallest {self.scale} "
                     + ("traced" if self.predicted else "measured")]
        elif self.predicted:
            lines = [f"{self.name}, {self.basis}: the largest {self.scale} under {limit} of CUDA reserved memory is "
                     f"{_value(best.max_fitting)}, with {best.engine}",
                     "  (a trace under fake tensors replayed through a model of the caching allocator; time per sample "
                     "needs a GPU)"]
            if self.unseen:  # one reason a line: the answer box stays readable
                lines.append(f"  a floor, not a bound: the trace does not see this memory, so a smaller {self.scale} "
                             "may be the largest (confirm with --verify on the GPU):")
                lines.extend(f"    {why}" for why in self.unseen)
        else:
            checked = self.verified or {}
            value = checked.get("true_max_fitting", best.max_fitting)
            seconds, label = best.seconds_per_sample(value)
            lines = [f"{self.name}: the largest {self.scale} under {limit} ({self.total}) is "
                     f"{_value(value)}, with {best.engine} ({format_seconds(seconds)} per sample, {label}); "
                     + (f"measured, in fresh processes at {len(checked['searched'])} values" if "true_max_fitting"
                        in checked else _reach(best))]
        for fit in self.engines:
            if fit.model is None:
                lines.append(f"  {fit.engine:<19} {fit.reason}")
                continue
            if self.predicted:
                lines.append(f"  {fit.engine:<19} {_predicted_line(fit, self.scale, self.limit)}")
                continue
            measured = ", ".join(f"{v}: {format_bytes(total)}" for v, total, _ in sorted(fit.points))
            where = ("does not fit at the smallest value measured" if fit.max_fitting is None else
                     f"up to {self.scale}={_value(fit.max_fitting)} ({_reach(fit)})")
            per = ""
            if fit.max_fitting is not None:
                seconds, label = fit.seconds_per_sample(fit.max_fitting)
                per = f"  {format_seconds(seconds)} per sample ({label})"
            lines.append(f"  {fit.engine:<19} {where}{per}  {fit.model.kind} model, predicted the largest point "
                         f"within {100 * fit.model.check_error:.1f}%  (measured {measured})"
                         + (f"  not traced: {fit.untraced}" if fit.untraced else "")
                         + (f"  not measured nearer the answer: {fit.unmeasured}" if fit.unmeasured else ""))
        if self.verified:
            v = self.verified
            lines.append(f"verified: {v['engine']} at {self.scale}={v['value']}: predicted {format_bytes(v['predicted'])}, "
                         f"measured {format_bytes(v['measured'])} (error {100 * v['error']:+.1f}%)")
            if "true_max_fitting" in v:
                off = v["value"] - v["true_max_fitting"]
                lines.append(f"measured: the largest {self.scale} under {limit} is {v['true_max_fitting']} "
                             f"({len(v['searched'])} values measured); the prediction was "
                             + ("exact" if off == 0 else f"{abs(off)} {'over' if off > 0 else 'under'}"))
        return lines

    def curve_values(self, fit: EngineFit) -> list[int]:
        """Where the records hold the model's prediction: the measured values, the largest fitting one, and
        a grid out to a little past it (at most 8x the largest measured value), for the figure's curve."""
        measured = [v for v, _, _ in fit.points]
        reach = min(max(fit.max_fitting or 0, max(measured)) * 1.25, 8 * max(measured))
        grid = {int(round(v)) for v in np.linspace(min(measured), reach, 24)}
        return sorted(grid | set(measured) | ({fit.max_fitting} if fit.max_fitting and fit.max_fitting < SEARCH_LIMIT
                                              else set()))

    def records(self) -> list[dict]:
        """Tidy rows: per engine and measured value its total, per engine the model's check error and the
        largest fitting value (or a `not_applicable` status saying why it has none), and the verification's
        error."""
        from benchlib.records import make_record
        from benchlib.records.schema import status_record

        rows = []
        for fit in self.engines:
            labels = dict(benchmark=self.name, case=f"fit {self.scale}", engine=fit.engine, device=self.device,
                          dtype="float32")
            common = {"scale": self.scale, "limit": self.limit, "margin": self.margin, "total": self.total,
                      "basis": self.basis,
                      **({"unseen": self.unseen} if self.unseen else {})}
            if fit.reason:  # not applicable here, not traceable, too few points: said, so no engine leaves no trace
                rows.append(status_record(status="not_applicable", message=fit.reason, params=common, **labels))
            for value, total, seconds in fit.points:
                rows.append(make_record(**labels, metric="fit_total_bytes", value=float(total), unit="B",
                                        params={**common, "value": value}))
                rows.append(make_record(**labels, metric="time", value=seconds, unit="s", params={**common, "value": value}))
            for value, peak in fit.traced.items():
                if self.predicted:  # the trace replayed through the allocator model: the prediction itself
                    rows.append(make_record(**labels, metric="predicted_total_bytes", value=float(peak), unit="B",
                                            params={**common, "value": value, "model": TRACE}))
                else:
                    rows.append(make_record(**labels, metric="traced_peak_bytes", value=float(peak), unit="B",
                                            params={**common, "value": value}))
            if fit.model is not None:
                beyond_traces = self.predicted and (fit.max_fitting or 0) > max(fit.traced)
                for value in self.curve_values(fit) if not self.predicted else (
                        _extrapolated_values(fit) if beyond_traces else []):
                    rows.append(make_record(**labels, metric="predicted_total_bytes", value=fit.model(value), unit="B",
                                            params={**common, "value": value, "model": fit.model.kind}))
                rows.append(make_record(**labels, metric="fit_check_error", value=fit.model.check_error, unit="ratio",
                                        params={**common, "model": fit.model.kind}))
                beyond = self.predicted and fit.max_fitting is not None and fit.max_fitting > max(fit.traced)
                rows.append(make_record(**labels, metric="max_fitting", value=float(fit.max_fitting or 0), unit="",
                                        params={**common, "model": fit.model.kind,
                                                **({"extrapolated_beyond": max(fit.traced)} if beyond else {})}))
            if self.verified and self.verified["engine"] == fit.engine:
                rows.append(make_record(**labels, metric="fit_verify_error", value=self.verified["error"], unit="ratio",
                                        params={**common, "value": self.verified["value"],
                                                "predicted": self.verified["predicted"],
                                                "measured": self.verified["measured"]}))
                if "true_max_fitting" in self.verified:
                    rows.append(make_record(**labels, metric="true_max_fitting", value=float(self.verified[
                        "true_max_fitting"]), unit="", params={**common, "predicted": self.verified["value"],
                                                               "searched": {str(value): total for value, total in
                                                                            self.verified["searched"].items()}}))
        return rows


def _extrapolated_values(fit: EngineFit) -> list[int]:
    """Where a prediction's size model is recorded beyond its traces: from the farthest trace to a little past its
    largest fitting value, for the figure's dashed line."""
    farthest = max(fit.traced)
    return sorted({int(round(v)) for v in np.geomspace(farthest, fit.max_fitting * 1.25, 12)} | {fit.max_fitting})


def _predicted_line(fit: EngineFit, scale: str, limit: int) -> str:
    """One engine's prediction without a GPU: where its predicted reserved peak crosses the limit, and by how much
    (the bytes either side of it can round to the limit's own figure)."""
    traced, largest = fit.traced, fit.max_fitting
    if largest is None:
        smallest = min(traced)
        return (f"does not fit at the smallest {scale} traced (predicted reserved at {smallest}: "
                f"{format_bytes(traced[smallest])})")
    farthest = max(traced)
    if largest >= SEARCH_LIMIT:
        return (f"fits at any {scale}: the predicted reserved peak does not grow (at {farthest}: "
                f"{format_bytes(traced[farthest])})")
    if largest > farthest:
        return (f"up to {scale}={largest}, extrapolated ({fit.model.kind} model past the farthest trace, {farthest}: "
                f"{format_bytes(traced[farthest])}; its operators grow with {scale})")
    over = f"; at {largest + 1} {format_bytes(traced[largest + 1] - limit)} over" if largest + 1 in traced else ""
    return (f"up to {scale}={largest}  (predicted reserved there {format_bytes(traced[largest])}, "
            f"{format_bytes(limit - traced[largest])} under{over}; {len(traced)} traces)")


def _reach(fit: EngineFit) -> str:
    """How a predicted value stands to the measured ones: within them, or extrapolated how far, and the upper bound
    it was read from."""
    error = f"its size model's out-of-sample error {100 * fit.model.check_error:.1f}% added"
    if math.isnan(fit.extrapolation) or fit.extrapolation <= 1.0:
        return f"predicted within the measured values, {error}"
    largest = max(value for value, _, _ in fit.points)
    return f"predicted, extrapolated {fit.extrapolation:.2f}x past the largest measured value ({largest}), {error}"


def _value(value: int) -> str:
    return "any value" if value >= SEARCH_LIMIT else str(value)


def scale_points(value: Any, scale: str) -> list[int]:
    """The values of `scale` measured: `FRACTIONS` of its given value, distinct, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FitError(f"--scale {scale}: its value is {value!r}; a scale parameter is an integer (a batch size, "
                       "a sequence length)")
    points = sorted({max(1, round(value * fraction)) for fraction in FRACTIONS})
    if len(points) < MIN_POINTS:
        raise FitError(f"--scale {scale}={value} gives only {len(points)} distinct values to measure "
                       f"({points}); give a value of 8 or more with -p {scale}=N")
    return points


def _asked(path: str | Path, memory: Any, scale: str, engines: Sequence[str] | None,
           params: Mapping[str, Any] | None) -> tuple[Any, Any, dict, int, float, list[str]]:
    """What a fit asks, checked before anything is measured: the model file (read and form-checked), its form, the
    parameter values, the limit in bytes and its margin (`memory`: a size, or a `MemoryLimit`) and the engines
    (each a technique or a combination), or FitError."""
    from benchlib.engines.techniques import CombinationError
    from benchlib.usermodel import declare_model_files
    from benchlib.usermodel.case import combination_of
    from benchlib.usermodel.gate import parse_bytes
    from benchlib.usermodel.measuring import TORCH_FORM

    memory, margin = (memory.size, memory.margin) if isinstance(memory, MemoryLimit) else (memory, 0.0)
    try:
        limit = parse_bytes(memory)
    except ValueError as error:
        raise FitError(f"--memory: {error}") from None
    if not 0.0 <= margin < 1.0:
        raise FitError(f"--margin {margin:g}: a share of the limit kept free, from 0 (none) up to below 1 (e.g. 10%)")
    benchmark, (model_file,), form = declare_model_files([path])
    if form is not TORCH_FORM:
        raise FitError(f"{model_file.path}: fit takes a model file in the torch form (this one is in the array form)")
    if scale not in model_file.parameters:
        raise FitError(f"--scale {scale!r} is not a parameter of {model_file.path.name}; its parameters: "
                       f"{', '.join(model_file.parameters) or 'none'}")
    named = list(engines or [engine for engine in form.engines if engine not in form.sweep_engines])
    try:  # each a technique or a combination, named in the registry's order as its records will carry it
        chosen = list(dict.fromkeys(combination_of(model_file, engine).name for engine in named))
    except CombinationError as error:
        raise FitError(f"--engines: {error}") from None
    by_name = {parameter.name: parameter for parameter in benchmark.parameters}
    typed = {name: by_name[name].parse(value) if isinstance(value, str) and name in by_name else value
             for name, value in (params or {}).items()}  # -p text, as `run` reads it
    values = benchmark.config(typed).plain()
    return model_file, form, {name: values[name] for name in model_file.parameters}, limit, margin, chosen


def fit(path: str | Path, *, memory: Any, scale: str, device: str = "cpu", engines: Sequence[str] | None = None,
        params: Mapping[str, Any] | None = None, verify: bool | None = None,
        progress: Callable[[str], None] = print) -> FitResult:
    """Fit every engine of the model file at `path` (the torch form) to the memory limit `memory` (bytes,
    or "24 GB", "80 GiB"..., or a `MemoryLimit` that keeps a margin free) over the integer parameter `scale`; see
    the module's docstring. `verify` (default: wherever this machine can hold the limit) measures the answer in
    fresh processes before it is given."""
    from benchlib.measure import Device, resolve_device
    from benchlib.measure.devices import cuda_without_gpu

    model_file, form, values, limit, margin, chosen = _asked(path, memory, scale, engines, params)
    points = scale_points(values[scale], scale)
    predicted = cuda_without_gpu(device)
    if predicted and verify:
        raise FitError("--verify measures the best engine on the device, and this machine has no GPU; without "
                       "--verify, --device cuda predicts from a trace under fake tensors")
    target = Device("cuda", int(device.partition(":")[2] or 0)) if predicted else resolve_device(device)
    usable = limit * (1.0 - margin)  # what every answer stays under
    if verify is None:  # confirmed by default wherever this machine can hold the limit
        from benchlib.measure.isolation import available_memory

        verify = not predicted and limit <= available_memory(target)
    total = "the allocator's reserved peak" if target.is_cuda else "the process's resident high-water mark"
    fits = [EngineFit(engine) for engine in chosen]
    plan_reasons = form.plan(model_file, values, target, chosen, {}).reasons
    for engine_fit in fits:
        engine_fit.reason = plan_reasons.get(engine_fit.engine, "")
    if predicted:
        from benchlib.usermodel.cuda_prediction import predict_fit

        result = predict_fit(model_file, fits, values, scale, usable, target.name, progress)
        return dataclasses.replace(result, limit=limit, margin=margin)
    skipped: dict[str, list[str]] = {fit.engine: [] for fit in fits}
    for value in points:
        for engine_fit in fits:
            if engine_fit.reason:
                continue
            outcome = _measure(model_file, engine_fit.engine, {**values, scale: value}, target)
            if isinstance(outcome, str):  # at this value only (micro-batches need a multiple of their count)
                skipped[engine_fit.engine].append(f"{scale}={value}: {outcome}")
                progress(f"{model_file.name} {engine_fit.engine} {scale}={value}: {outcome}")
                continue
            engine_fit.points.append((value, *outcome))
            progress(f"{model_file.name} {engine_fit.engine} {scale}={value}: {format_bytes(outcome[0])}, "
                     f"{format_seconds(outcome[1])}/step")
    for engine_fit in fits:
        if len(engine_fit.points) < MIN_POINTS and not engine_fit.reason:
            engine_fit.reason = (f"{len(engine_fit.points)} of {len(points)} values measured, {MIN_POINTS} needed: "
                                 + "; ".join(skipped[engine_fit.engine]))
        if not engine_fit.reason:
            _model(engine_fit, model_file, values, scale, progress)
            _approach(engine_fit, model_file, values, scale, target, usable, progress)
            engine_fit.max_fitting = engine_fit.answer(usable)
    result = FitResult(model_file.name, scale, limit, target.name, total, fits, margin=margin)
    best = result.best
    if verify and best is not None:
        result.verified = _verify(model_file, best, values, scale, target, usable, progress)
    return result


def _model(engine_fit: EngineFit, model_file, values: dict, scale: str, progress) -> None:
    """The engine's size model over its measured points: the better of linear and quadratic, or the trace model
    where it predicts the largest measured total within `TRACE_TRUSTED`."""
    engine_fit.model = choose_model([v for v, _, _ in engine_fit.points], [t for _, t, _ in engine_fit.points])
    if not engine_fit.untraced:  # a step torch could not trace, or never traces, is not tried again
        _trace(engine_fit, model_file, values, scale, progress)


def _approach(engine_fit: EngineFit, model_file, values: dict, scale: str, device, limit: float, progress) -> None:
    """Measured points grow toward the answer: while it lies more than `REACH` times past the largest measured
    value, the next point is measured at `REACH` times that value (or the answer, if nearer) in a fresh process
    and the size model is fitted again. Where this machine cannot hold the next point, or its measurement fails,
    `unmeasured` says so and the answer stays an extrapolation."""
    from benchlib.measure.isolation import available_memory

    available = available_memory(device)
    if limit > available:  # the answer could not be measured here anyway: the line says how far it extrapolated
        engine_fit.unmeasured = (f"the limit is above the {format_bytes(available)} {device.name} has available, so "
                                 "the points stop at the value given")
        return
    while True:
        answer = engine_fit.answer(limit)
        largest = max(value for value, _, _ in engine_fit.points)
        if answer is None or answer >= SEARCH_LIMIT or answer <= REACH * largest:
            return
        value = min(answer, REACH * largest)  # its predicted total is under the limit, which this machine holds
        outcome = _measure(model_file, engine_fit.engine, {**values, scale: value}, device)
        if isinstance(outcome, str):
            engine_fit.unmeasured = f"{scale}={value}: {outcome}"
            progress(f"{model_file.name} {engine_fit.engine} {scale}={value}: {outcome}")
            return
        engine_fit.points.append((value, *outcome))
        progress(f"{model_file.name} {engine_fit.engine} {scale}={value}: {format_bytes(outcome[0])}, "
                 f"{format_seconds(outcome[1])}/step (toward the answer, predicted {answer})")
        _model(engine_fit, model_file, values, scale, progress)


def _trace(engine_fit: EngineFit, model_file, values: dict, scale: str, progress) -> None:
    """Trace the engine's step (`traced_peak`) and take the trace model where it predicts within `TRACE_TRUSTED`;
    where torch cannot trace it, say why and keep the measured points' model."""
    from benchlib.usermodel.case import combination_of

    untraceable = combination_of(model_file, engine_fit.engine).untraceable
    if untraceable is not None:
        engine_fit.untraced = untraceable
        return
    try:
        model, traced = trace_model([(v, total) for v, total, _ in engine_fit.points],
                                    lambda value: traced_peak(model_file, engine_fit.engine, {**values, scale: value}))
    except Exception as error:  # noqa: BLE001 - torch's tracer or the file's code under fake tensors: said, not fatal
        engine_fit.untraced = untraced_reason(error)
        progress(f"{model_file.name} {engine_fit.engine}: not traced ({engine_fit.untraced})")
        return
    engine_fit.traced = traced
    progress(f"{model_file.name} {engine_fit.engine}: traced at {scale}={', '.join(map(str, traced))}; the trace "
             f"model predicted the largest measured total within {100 * model.check_error:.1f}%")
    if model.check_error <= TRACE_TRUSTED:
        engine_fit.model = model


def untraced_reason(error: Exception) -> str:
    """Why a step could not be traced under fake tensors, in one line: the common case (the step asks a tensor for
    a Python number, which a fake tensor does not hold) in words, any other as torch said it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    said = f"{type(error).__name__}: {first if len(first) <= 240 else first[:240].rsplit(' ', 1)[0] + ' ...'}"
    if isinstance(error, DataDependentOutputException):
        return (f"the step reads a value out of a tensor (.item(), float(), a data-dependent shape), which a fake "
                f"tensor does not hold ({said})")
    return said


def _measure(model_file, engine: str, values: dict, device) -> tuple[int, float] | str:
    """(total bytes, median seconds per step) of one engine's step at `values`, in a fresh process, or why not."""
    from benchlib.measure import CaseFailed, CaseNotApplicable, IsolationOptions, run_isolated
    from benchlib.usermodel.measuring import TARGET, TORCH_FORM, preload

    with tempfile.TemporaryDirectory(prefix="benchlib-fit-") as gradients:
        try:
            result = run_isolated(TARGET, {"path": str(model_file.path), "engine": engine, "values": values,
                                           "gradient_dir": gradients},
                                  name=f"{model_file.name}/{engine}", device=device.name,
                                  options=IsolationOptions(warmup=WARMUP, repeats=STEPS, timeline=False,
                                                           malloc=USERS_ALLOCATOR,
                                                           preload=preload(TORCH_FORM, model_file, engine, device)))
        except CaseNotApplicable as refused:
            return f"not applicable: {refused.reason}"
        except CaseFailed as failed:
            return f"failed: {failed.reason}"
    measurement = result.measurement
    if device.is_cuda:
        return int(measurement.cuda_allocator[CUDA_RESERVED_PEAK]), measurement.median_s
    return int((measurement.baseline_bytes or 0) + (measurement.peak_bytes or 0)), measurement.median_s


def _verify(model_file, best: EngineFit, values: dict, scale: str, device, limit: int, progress) -> dict | None:
    """The best engine measured at its largest fitting value, where this machine has the memory for it, then the
    true largest value found by measurement (`_largest_measured`)."""
    from benchlib.measure.isolation import available_memory

    value = best.max_fitting
    predicted = best.model(value)
    available = available_memory(device)
    if value >= SEARCH_LIMIT or predicted > available:
        progress(f"verify: {best.engine} at {scale}={_value(value)} needs {format_bytes(int(predicted))}; "
                 f"{device.name} has {format_bytes(available)} available: not measured")
        return None
    outcome = _measure(model_file, best.engine, {**values, scale: value}, device)
    if isinstance(outcome, str):
        progress(f"verify: {best.engine} at {scale}={value}: {outcome}")
        return None
    measured = outcome[0]
    verified = {"engine": best.engine, "value": value, "predicted": int(predicted), "measured": measured,
                "error": (predicted - measured) / measured}
    largest = _largest_measured(lambda v: _measure(model_file, best.engine, {**values, scale: v}, device),
                                value, measured, limit, best, available, progress, scale)
    return verified | ({"true_max_fitting": largest[0], "searched": largest[1]} if largest else {})


def _largest_measured(measure: Callable[[int], tuple[int, float] | str], predicted_value: int, predicted_total: int,
                      limit: int, best: EngineFit, affordable: float, progress, scale: str) -> tuple[int, dict] | None:
    """The largest value whose measured total stays under `limit`, searched by measurement from the predicted value
    and the fit's points (one fresh process per value): each next value is where the straight line through the two
    nearest measured totals crosses the limit (`_crossing`), bisection every other step once the answer is
    bracketed, so a prediction that is far off costs a few processes, not one per doubling. Returns (that value,
    every total measured on the way), or None where a measurement failed, nothing measured is under the limit,
    or the next value would not fit this machine (`affordable` bytes)."""
    searched = {predicted_value: predicted_total}
    interpolated = False
    while True:
        totals = {value: total for value, total, _ in best.points} | searched
        under = [value for value, total in totals.items() if total <= limit]
        if not under:
            return None
        low = max(under)
        high = min((value for value, total in totals.items() if total > limit and value > low), default=None)
        if high is not None and high - low <= 1:
            return low, dict(sorted(searched.items()))
        if high is None:  # not bracketed yet: along the line through the two largest values under the limit
            below = sorted(under)[-2:]
            value = max(low + 1, _crossing(below[0], totals[below[0]], low, totals[low], limit))
        elif interpolated:  # the bracket's line did not end it: halve, so the search ends in any case
            value, interpolated = (low + high) // 2, False
        else:
            value = min(high - 1, max(low + 1, _crossing(low, totals[low], high, totals[high], limit)))
            interpolated = True
        if best.model(value) > affordable:
            progress(f"verify: {scale}={value} would need more memory than this machine has: search stopped")
            return None
        outcome = measure(value)
        if isinstance(outcome, str):
            progress(f"verify: {scale}={value}: {outcome}: search stopped")
            return None
        searched[value] = outcome[0]
        progress(f"verify: {best.engine} at {scale}={value}: {format_bytes(outcome[0])} "
                 f"({'under' if outcome[0] <= limit else 'over'} the limit)")


def _crossing(value_a: int, total_a: int, value_b: int, total_b: int, limit: int) -> int:
    """The value where the straight line through two measured (value, total) points reaches `limit`, rounded
    down; twice the larger value where the line does not rise (the totals are one allocator step apart)."""
    if value_a == value_b or total_b <= total_a:
        return 2 * max(value_a, value_b)
    return int(value_b + (limit - total_b) * (value_b - value_a) / (total_b - total_a))
