"""`fit`'s answer: per engine its measured points, size model and largest fitting value, confirmed by
measurement where the machine can; the two answers (the largest value, and the fastest engine at the largest
value every fitting engine reaches); its lines, its table and its records.

Total memory, defined once: on CUDA the caching allocator's reserved peak (`cuda_reserved_peak_bytes`), which
is what an out-of-memory error is about; on the CPU the step process's resident high-water mark (its resident
memory before the step plus the step's peak above it), which includes the interpreter and torch, since those
must fit too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from benchlib.fit.search import SEARCH_LIMIT
from benchlib.fit.sizing import TRACE, SizeModel
from benchlib.records.metrics import METRICS
from benchlib.units import format_bytes, format_seconds

MEASURED, CONFIRMED, PREDICTED = "measured", "confirmed", "predicted"
ENGINE_WIDTH = 24  # the engine column of the lines: a longer combination's name pushes its line on
CLOSE = 0.05  # times per sample this close are not told apart by the few steps a fit times
MEMORY_MISS_PERCENT = 5.0  # a confirmed value whose predicted memory missed by this much says so beside it
FIT_METRICS = (  # what a fit records: a command's, not a benchmark's, so registered where it is made
    ("fit_total_bytes", "B", "memory", "total memory of one step at params.value of the parameter params.scale: on CUDA "
     "the allocator's reserved peak, on the CPU the process's resident high-water mark (params.total says which; "
     "params.confirms: measured to confirm an answer, not a point of the size model)"),
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
HIGHER_IS_BETTER = ("max_fitting", "true_max_fitting")  # a larger value fitting is the better outcome
for _metric in FIT_METRICS:
    METRICS.register(*_metric, better="higher" if _metric[0] in HIGHER_IS_BETTER else None)


@dataclass
class EngineFit:
    """One engine: its measured points (value, total bytes, seconds per step), its size model, the largest value
    predicted to fit, and what measurement confirmed; `reason` where it could not be fitted (not applicable,
    failed)."""

    engine: str
    points: list[tuple[int, int, float]] = field(default_factory=list)
    model: SizeModel | None = None
    max_fitting: int | None = None
    reason: str = ""
    traced: dict[int, int] = field(default_factory=dict)  # value -> traced peak bytes, where the step was traced
    untraced: str = ""  # why it was not
    unmeasured: str = ""  # why the points stop short of the answer (the machine cannot hold the next one), if they do
    unconfirmed: str = ""  # why confirmation gave up (no value held the limit in every process): not confirmed
    checked: dict[int, int] = field(default_factory=dict)  # value -> total measured to confirm an answer
    confirmed: int | None = None  # the largest value measured under the limit, searched up to the first over it
    multiple: int = 1  # what the values asked beyond the grid are multiples of (micro-batches split evenly)
    failed: dict[int, str] = field(default_factory=dict)  # value -> why its step failed there (raised, killed, timed
    # out): every answer stays below the smallest
    flat: str = ""  # why no size model is read: its totals do not measurably grow over the values measured
    # predicted without a GPU: how far a traced reserved peak may lie from the GPU's (`predicted.TRACE_TOLERANCE`),
    # the interval of a total read from its trace; 0 where the totals are measured
    tolerance: float = 0.0

    @property
    def ceiling(self) -> int | None:
        """The smallest value whose step failed: no answer at or past it."""
        return min(self.failed, default=None)

    def fail(self, value: int, why: str, limit: float) -> None:
        """Note that the step failed at `value`, and take back any answer at or past it."""
        self.failed[value] = why
        if self.confirmed is not None and self.confirmed >= value:
            self.confirmed = None
        if self.model is not None and self.points:
            self.max_fitting = self.answer(limit)

    @property
    def largest(self) -> int | None:
        """This engine's answer: confirmed by measurement where it was, else predicted."""
        return self.confirmed if self.confirmed is not None else self.max_fitting

    def answer(self, limit: float) -> int | None:
        """The largest value whose predicted total, raised by the size model's own out-of-sample error (its upper
        bound), stays under `limit`, and never below a measured value whose measured total does; None when no
        measured total is under it. Where the step failed at some value, or its totals do not grow (`flat`), the
        largest value measured under `limit` (below the failure)."""
        under = [value for value, total, _ in self.points if total <= limit]
        ceiling = self.ceiling
        if ceiling is not None or self.flat:  # past a failure, or from totals that do not grow, nothing is
            # extrapolated: the largest value measured under the limit (below the failure)
            measured = {value: total for value, total, _ in self.points} | self.checked
            return max((value for value, total in measured.items()
                        if total <= limit and (ceiling is None or value < ceiling)), default=None)
        if not under:
            return None
        start = min(value for value, _, _ in self.points)
        predicted = self.model.largest_under(limit / (1 + max(self.model.check_error, 0.0)), start)
        if predicted is not None and predicted < SEARCH_LIMIT:
            predicted -= predicted % self.multiple
        return max(predicted or 0, max(under))

    def total_at(self, value: int) -> tuple[float, float, float, str]:
        """(total, low, high, basis) at `value`: measured where a process ran there (low = high = total); predicted
        from a trace there, within `tolerance`; else the size model's prediction and its interval."""
        measured = {v: total for v, total, _ in self.points} | self.checked
        if value in measured:
            return (float(measured[value]),) * 3 + (CONFIRMED if value in self.checked else MEASURED,)
        if self.tolerance and value in self.traced:  # the trace itself, within what the GPU truth tables allow it
            traced = float(self.traced[value])
            return traced, traced * (1 - self.tolerance), traced * (1 + self.tolerance), PREDICTED
        low, high = self.model.bounds(value)
        return self.model(value), low, high, PREDICTED

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
    """`fit`'s answer: every engine's fit and the two answers; with verification, what measurement confirmed."""

    name: str
    scale: str
    limit: int
    device: str
    total: str
    engines: list[EngineFit]
    basis: str = MEASURED  # or predicted.BASIS: the totals are predicted, nothing ran on the device
    unseen: list[str] = field(default_factory=list)  # predicted: what CUDA's kernels take that the trace did not see
    target: str = ""  # predicted: the GPU and the torch whose kernel choices the trace made (cuda_policy)
    assumed: list[str] = field(default_factory=list)  # predicted: where a choice was unknown, the larger branch taken
    attention: dict[str, list[str]] = field(default_factory=dict)  # predicted: the attention kernels, by engine
    margin: float = 0.0  # the share of the limit kept free: answers stay under limit * (1 - margin)
    world_size: int = 1  # the ranks each step ran on: values are per rank, totals the worst rank's
    per: str = "sample"  # what one unit of `scale` is, for times per unit: a sample where it is a batch's size

    @property
    def usable(self) -> float:
        return self.limit * (1.0 - self.margin)

    @property
    def fitted(self) -> list[EngineFit]:
        return [fit for fit in self.engines if fit.max_fitting is not None]

    @property
    def predicted(self) -> bool:
        return self.basis != MEASURED

    @property
    def failed_engines(self) -> list[str]:
        """The engines asked whose step failed (raised, was killed, timed out) wherever it was tried: no answer."""
        return [fit.engine for fit in self.engines if fit.reason and fit.failed]

    @property
    def best(self) -> EngineFit | None:
        """The engine reaching the largest value, one whose confirmation gave up only where none is confirmed; then
        the least time per sample, or, predicted, the least total."""
        def rank(fit: EngineFit) -> tuple:  # a measured engine before one only predicted at the same value
            seconds = fit.seconds_per_sample(fit.largest)[0]
            return not fit.unconfirmed, fit.largest, bool(fit.points) or self.predicted, \
                -(0.0 if math.isnan(seconds) else seconds), -fit.model(fit.largest)

        return max(self.fitted, key=rank, default=None)

    @property
    def common_value(self) -> int | None:
        """The largest value every fitting engine measured reaches."""
        return min((fit.largest for fit in self.fitted if fit.points), default=None)

    @property
    def timed_value(self) -> int | None:
        """The largest value every fitting engine was measured at: where their times per sample compare (time per
        sample falls as the value grows, so engines timed at different values would not)."""
        measured = [{value for value, _, _ in fit.points} for fit in self.fitted if fit.points]
        return max(set.intersection(*measured), default=None) if measured else None

    @property
    def fastest(self) -> EngineFit | None:
        """The engine with the least time per sample at `timed_value` (measured engines only), the one to run at
        `common_value`."""
        timed = self.timed_value
        if timed is None:
            return None
        return min((fit for fit in self.fitted if fit.points), key=lambda fit: fit.seconds_per_sample(timed)[0])

    def limit_text(self) -> str:
        return format_bytes(self.limit) + (f" less a {100 * self.margin:g}% margin ({format_bytes(int(self.usable))})"
                                           if self.margin else "")

    def answers(self) -> list[str]:
        """The answer in words: the largest value and the engine reaching it; the fastest engine at the largest value
        every fitting engine reaches."""
        best, limit = self.best, self.limit_text()
        if not any(fit.model is not None for fit in self.engines):
            return [f"{self.name}: no engine could be {'predicted' if self.predicted else 'measured'}; each says why"]
        if best is None:
            done = "predicted" if self.predicted else "measured"
            answered = sum(fit.model is not None for fit in self.engines)
            unanswered = len(self.engines) - answered
            head = "no engine fits" if not unanswered else (f"the one engine {done} does not fit" if answered == 1
                                                             else f"none of the {answered} engines {done} fits")
            return [f"{self.name}: {head} {limit} ({self.total}) even at the smallest {self.scale} "
                    + ("traced" if self.predicted else "measured")
                    + (f"; {unanswered} more could not be {done} (each says why)" if unanswered else "")]
        if self.predicted:
            lines = [f"{self.name}, {self.basis}: the largest {self.scale} under {limit} of CUDA reserved memory is "
                     f"{_value(best.largest)}{self._per_rank(best.largest)}, with {best.engine}",
                     *([f"  for {self.target}"] if self.target else []),
                     *(["  attention, as CUDA's kernels there: " + "; ".join(
                         f"{engine} {', '.join(kernels)}" for engine, kernels in self.attention.items())]
                       if self.attention else []),
                     "  (a trace under fake tensors replayed through a model of the caching allocator"
                     + (f"; rank 0 of {self.world_size} simulated in one process under torch's fake process group, "
                        "whose collectives move nothing" if self.world_size > 1 else "")
                     + f"; time per {self.per} needs a GPU)"]
            if self.unseen:  # one reason a line: the answer box stays readable
                lines.append(f"  its memory is a floor, so this {self.scale} is an upper bound: the trace does not see the "
                             f"memory below, and a smaller {self.scale} may be the largest (confirm with --verify on "
                             "the GPU):")
                lines.extend(f"    {why}" for why in self.unseen)
            if self.assumed:
                lines.append("  where CUDA's choice could not be known, the larger branch was taken:")
                lines.extend(f"    {why}" for why in self.assumed)
            return lines
        seconds, label = best.seconds_per_sample(best.largest)
        lines = [f"{self.name}: the largest {self.scale} under {limit} ({self.total}) is {_value(best.largest)}"
                 + self._per_rank(best.largest) + f", with {best.engine} ({format_seconds(seconds)} per {self.per}, {label}); {_basis(best)}"
                 + (_bound(best) if best.largest not in best.checked else "")]
        fastest, common, timed = self.fastest, self.common_value, self.timed_value
        if fastest is not None and len([fit for fit in self.fitted if fit.points]) > 1:
            seconds = fastest.seconds_per_sample(timed)[0]
            lines.append(f"{self.name}: the fastest at {self.scale}={_value(common)}, the largest every fitting engine "
                         f"reaches, is {fastest.engine} ({format_seconds(seconds)} per {self.per} at {self.scale}={timed}, "
                         f"the largest value all were timed at); {_basis(fastest, common)}"
                         + (_bound(fastest) if common not in fastest.checked and common not in
                            {v for v, _, _ in fastest.points} else "")
                         + self._runner_up(fastest, timed))
        return lines

    def _per_rank(self, value: int) -> str:
        """" per rank (V across N ranks)" on several ranks; nothing in one process."""
        if self.world_size < 2:
            return ""
        return f" per rank ({_value(value * self.world_size)} across {self.world_size} ranks)"

    def _runner_up(self, fastest: EngineFit, timed: int) -> str:
        """Where the next engine's time is within `CLOSE` of the fastest's, that the medians of a few steps do not
        tell them apart (`benchlib run` compares times with intervals)."""
        seconds = fastest.seconds_per_sample(timed)[0]
        others = [(fit.seconds_per_sample(timed)[0], fit.engine) for fit in self.fitted
                  if fit is not fastest and fit.points]
        if not others:
            return ""
        second, engine = min(others)
        if second > seconds * (1 + CLOSE):
            return ""
        return (f"; {engine} is within {100 * (second / seconds - 1):.0f}%, closer than a few timed steps tell apart "
                "(benchlib run compares them with intervals)")

    def rows(self) -> list[dict]:
        """One row per engine, the table's: its largest value, the total there (measured, confirmed, or predicted with
        its interval), time per sample there, how its answer was reached, and why it has none."""
        rows = []
        for fit in self.engines:
            row = {"engine": fit.engine, "largest": None, "total_bytes": math.nan, "total_low": math.nan,
                   "total_high": math.nan, "basis": "", "seconds_per_sample": math.nan, "time_basis": "",
                   "model": "", "reason": fit.reason}
            if fit.model is not None:
                row["model"] = f"{fit.model.kind}, {100 * fit.model.check_error:.1f}% out of sample"
            if fit.largest is not None and fit.largest < SEARCH_LIMIT:
                total, low, high, basis = fit.total_at(fit.largest)
                seconds, label = fit.seconds_per_sample(fit.largest)
                row.update(largest=fit.largest, total_bytes=total, total_low=low, total_high=high,
                           basis=_predicted_basis(self.basis, fit) if self.predicted else _basis(fit),
                           seconds_per_sample=seconds,
                           time_basis=label)
            elif fit.largest is not None:
                row.update(largest=fit.largest, basis=f"the total does not grow with {self.scale}")
            elif fit.model is not None:
                row["reason"] = row["reason"] or f"does not fit at the smallest {self.scale} measured"
            failure = fit.ceiling is not None and bool(fit.points) and (  # with no point, its reason says it
                f"its step failed at {self.scale}={fit.ceiling} ({fit.failed[fit.ceiling]}): answers stay below it")
            notes = [note for note in (failure, fit.flat, fit.untraced and f"not traced: {fit.untraced}",
                                       fit.unmeasured and f"not measured nearer the answer: {fit.unmeasured}") if note]
            row["reason"] = "; ".join([row["reason"], *notes] if row["reason"] else notes)
            rows.append(row | {"scale": self.scale, "answer": ""})
        self._mark_answers(rows)
        return rows

    def _mark_answers(self, rows: list[dict]) -> None:
        """The answers' sentences on the rows of the engines they name (on the first row where none fits), so the
        table carries them."""
        sentences = self.answers()
        owners = [self.best] * len(sentences)
        if not self.predicted and len(sentences) == 2:  # the second names the fastest at the common value
            owners[1] = self.fastest
        for row, fit in zip(rows, self.engines):
            mine = [index for index, owner in enumerate(owners) if owner is fit]
            row["answer"] = "\n".join(sentences[index] for index in mine)
            row["answer_order"] = min(mine, default=None)
        if self.best is None and rows:
            rows[0]["answer"], rows[0]["answer_order"] = "\n".join(sentences), 0

    def lines(self) -> list[str]:
        """The answers, then one aligned line per engine, then the verification."""
        lines = self.answers()
        width = min(max((len(fit.engine) for fit in self.engines), default=0), ENGINE_WIDTH)
        for row, fit in zip(self.rows(), self.engines):
            if fit.model is None or row["largest"] is None:
                lines.append(f"  {fit.engine:<{width}}  {row['reason']}")
                continue
            if self.predicted:
                lines.append(f"  {fit.engine:<{width}}  {_predicted_line(fit, self.scale, self.limit)}")
                continue
            total = "" if math.isnan(row["total_bytes"]) else _total_text(row)
            time = "" if math.isnan(row["seconds_per_sample"]) else \
                f"  {format_seconds(row['seconds_per_sample'])} per {self.per} ({row['time_basis']})"
            lines.append(f"  {fit.engine:<{width}}  up to {self.scale}={_value(row['largest'])}: {total}{time}; "
                         f"{row['basis']} ({fit.model.kind} model, {100 * fit.model.check_error:.1f}% out of sample)"
                         + (f"; {row['reason']}" if row["reason"] else ""))
        for fit in self.engines:  # each confirmation: how far the prediction was, and what measurement found
            error = None
            if fit.max_fitting in fit.checked:
                predicted, measured = fit.model(fit.max_fitting), fit.checked[fit.max_fitting]
                error = 100 * (predicted - measured) / measured
                lines.append(f"confirming {fit.engine} at {self.scale}={fit.max_fitting}: predicted "
                             f"{format_bytes(int(predicted))}, measured {format_bytes(measured)} (error {error:+.1f}%)")
            if fit.confirmed is not None and fit.checked:
                off, count = fit.max_fitting - fit.confirmed, len(fit.checked)
                verdict = ("the predicted value held" if off == 0 else
                           f"the prediction was {abs(off)} {'over' if off > 0 else 'under'}")
                if error is not None and abs(error) >= MEMORY_MISS_PERCENT:  # the value held, the bytes did not
                    verdict += f", though its memory there was predicted {error:+.1f}% off"
                lines.append(f"confirmed: under {self.limit_text()}, {fit.engine} reaches {self.scale}={fit.confirmed} "
                             f"({count} value{'s' if count > 1 else ''} measured to confirm it); {verdict}")
        return lines

    def curve_values(self, fit: EngineFit) -> list[int]:
        """Where the records hold the model's prediction: the measured values, the largest fitting one, and
        a grid out to a little past it (at most 8x the largest measured value), for the figure's curve."""
        measured = [v for v, _, _ in fit.points] or list(fit.traced)
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
                      **({"world_size": self.world_size} if self.world_size > 1 else {}),
                      "basis": self.basis,
                      **({"unseen": self.unseen} if self.unseen else {})}
            if fit.reason:  # not applicable here, not traceable, too few points: said, so no engine leaves no trace
                rows.append(status_record(status="failed" if fit.failed else "not_applicable", message=fit.reason,
                                          params=common, **labels))
            for value, why in sorted(fit.failed.items()):
                rows.append(status_record(status="failed", message=why, params={**common, "value": value}, **labels))
            for value, total, seconds in fit.points:
                rows.append(make_record(**labels, metric="fit_total_bytes", value=float(total), unit="B",
                                        params={**common, "value": value}))
                rows.append(make_record(**labels, metric="time", value=seconds, unit="s", params={**common, "value": value}))
            for value, total in fit.checked.items():
                rows.append(make_record(**labels, metric="fit_total_bytes", value=float(total), unit="B",
                                        params={**common, "value": value, "confirms": True}))
            for value, peak in fit.traced.items():
                if self.predicted:  # the trace replayed through the allocator model: the prediction itself
                    rows.append(make_record(**labels, metric="predicted_total_bytes", value=float(peak), unit="B",
                                            params={**common, "value": value, "model": TRACE}))
                else:
                    rows.append(make_record(**labels, metric="traced_peak_bytes", value=float(peak), unit="B",
                                            params={**common, "value": value}))
            if fit.model is not None:
                rows.extend(self._model_records(fit, labels, common))
            rows.extend(self._confirmed_records(fit, labels, common))
        return rows

    def _model_records(self, fit: EngineFit, labels: dict, common: dict) -> list[dict]:
        """The size model's curve, its check error and the largest value it answers."""
        from benchlib.records import make_record

        beyond_traces = self.predicted and (fit.max_fitting or 0) > max(fit.traced)
        values = _traced_curve_values(fit) if self.predicted else self.curve_values(fit)
        rows = [make_record(**labels, metric="predicted_total_bytes", value=fit.model(value), unit="B",
                            params={**common, "value": value, "model": fit.model.kind}) for value in values]
        rows.append(make_record(**labels, metric="fit_check_error", value=fit.model.check_error, unit="ratio",
                                params={**common, "model": fit.model.kind}))
        rows.append(make_record(**labels, metric="max_fitting", value=float(fit.max_fitting or 0), unit="",
                                params={**common, "model": fit.model.kind,
                                        **({"extrapolated_beyond": max(fit.traced)} if beyond_traces else {})}))
        return rows

    def _confirmed_records(self, fit: EngineFit, labels: dict, common: dict) -> list[dict]:
        """The prediction's error where its value was measured, and the largest value measurement confirmed."""
        from benchlib.records import make_record

        rows = []
        if fit.max_fitting in fit.checked:
            predicted, measured = fit.model(fit.max_fitting), fit.checked[fit.max_fitting]
            rows.append(make_record(**labels, metric="fit_verify_error", value=(predicted - measured) / measured,
                                    unit="ratio", params={**common, "value": fit.max_fitting,
                                                          "predicted": int(predicted), "measured": measured}))
        if fit.confirmed is not None:
            searched = {str(value): total for value, total in sorted(fit.checked.items())}
            rows.append(make_record(**labels, metric="true_max_fitting", value=float(fit.confirmed), unit="",
                                    params={**common, "predicted": fit.max_fitting, "searched": searched}))
        return rows


def _basis(fit: EngineFit, value: int | None = None) -> str:
    """How an engine's answer (or its total at `value`) was reached: measured there, confirmed by measurement in
    fresh processes, or predicted (within the measured values, or extrapolated how far)."""
    value = fit.largest if value is None else value
    if fit.unconfirmed and value == fit.largest:
        return f"not confirmed: {fit.unconfirmed}"
    if fit.confirmed is not None and value == fit.confirmed:
        over = [v for v, total in fit.checked.items() if v > value]
        return ("confirmed: measured in fresh processes" + (f", under the limit there and over it at {min(over)}"
                                                             if over else ", under the limit there"))
    if value in fit.checked:
        return "confirmed: measured there in a fresh process"
    if value in {v for v, _, _ in fit.points}:
        return "measured there"
    if not fit.points:
        return "predicted from its step traced under fake tensors, not measured"
    largest = max(v for v, _, _ in fit.points)
    if value <= largest:
        return "predicted within the measured values"
    return f"predicted, extrapolated {value / largest:.2f}x past the largest measured value ({largest})"


def _bound(fit: EngineFit) -> str:
    """What a predicted answer was read from: the size model's upper bound."""
    return f", read from its size model's upper bound (+{100 * max(fit.model.check_error, 0.0):.1f}%)"


def _total_text(row: dict) -> str:
    """A total, and its interval where it has one wider than the figures show."""
    total, low, high = (format_bytes(int(row[key])) for key in ("total_bytes", "total_low", "total_high"))
    return total if low == high else f"{total} [{low}, {high}]"


def _traced_curve_values(fit: EngineFit) -> list[int]:
    """Where a prediction's size model is recorded, for the figure's line through its traces: from the nearest
    trace to a little past the farther of the farthest trace and the largest fitting value (on a log axis)."""
    farthest = max(max(fit.traced), min(fit.max_fitting or 0, SEARCH_LIMIT - 1))
    grid = np.geomspace(min(fit.traced), farthest * 1.25, 24)
    return sorted({int(round(v)) for v in grid} | ({fit.max_fitting} if fit.max_fitting else set()))


def _predicted_basis(basis: str, fit: EngineFit) -> str:
    """How a predicted total was reached, with what its interval is: the trace's tolerance (`TRACE_TOLERANCE`)."""
    if fit.tolerance and fit.largest in fit.traced:
        return f"{basis} (±{100 * fit.tolerance:g}%: how near GPU truth tables hold traces)"
    return basis


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


def _value(value: int) -> str:
    return "any value" if value >= SEARCH_LIMIT else str(value)
