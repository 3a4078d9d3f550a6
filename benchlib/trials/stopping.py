"""When a case has run enough trials: its headline figure settled within a stated precision, or
identical across trials (an exact count or size), or the cap on trials reached. The reason is kept
as data (`trials_run` records), so every number says why it stopped where it did. A deadline (`benchlib run
--budget`) stops trials too, as `budget`."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from benchlib.errors import Refused
from benchlib.records.metrics import TRIALS_RUN  # noqa: F401 (re-exported: the record a trial loop writes)
from benchlib.analysis.stats import median_interval

PRECISION, DETERMINISTIC, MAX_TRIALS, BUDGET = "precision", "deterministic", "max_trials", "budget"
DEADLINE_ENV = "BENCHLIB_DEADLINE"  # set by `benchlib run --budget` or `--timeout` in each notebook's kernel
LEAST_TIMEOUT_S = 1.0  # a case's timeout at a deadline already past (the first child always runs): it fails, named
MIN_TRIALS = 3  # fewer give no interval worth the name: two trials bound the median by themselves


def relative_half_width(values: Sequence[float]) -> float:
    """Half the width of the median's 95% interval over the median: the precision the trials reached."""
    interval = median_interval(values)
    if interval.ratio == 0:
        return 0.0 if interval.ci_low == interval.ci_high == 0 else float("inf")
    return float((interval.ci_high - interval.ci_low) / 2 / abs(interval.ratio))


def stop_reason(values: Sequence[float], *, precision: float, max_trials: int,
                min_trials: int = MIN_TRIALS) -> str | None:
    """Why a case with these trial values stops now, or None to run another trial. `precision` 0 asks for
    all `max_trials`; a cap below `min_trials` stops there."""
    values = np.asarray(values, dtype=float)
    if values.size >= min_trials and precision > 0:
        if np.all(values == values[0]):
            return DETERMINISTIC
        if relative_half_width(values) <= precision:
            return PRECISION
    return MAX_TRIALS if values.size >= max_trials else None


class Deadline:
    """When measuring must end: a wall-clock time (`time.time()`), or None for no limit. `benchlib run
    --budget` or `--timeout` gives each notebook's kernel one in `DEADLINE_ENV`; `from_environment` reads it there."""

    def __init__(self, at: float | None = None, clock: Callable[[], float] = time.time):
        self.at, self.clock = at, clock

    @classmethod
    def from_environment(cls) -> "Deadline":
        text = os.environ.get(DEADLINE_ENV, "").strip()
        try:
            return cls(float(text) if text else None)
        except ValueError:
            raise Refused(f"{DEADLINE_ENV} must be a time in seconds since the epoch, got {text!r}") from None

    def left(self) -> float:
        return math.inf if self.at is None else self.at - self.clock()

    def within(self, measure: Callable[[float], Any], timeout_s: float) -> Any:
        """`measure(limit)`: one case in a process of its own, given `timeout_s`, or less where this deadline comes
        first. The run's --timeout or --budget ends the kernel then, so a case that hangs fails as itself first,
        named, saying so, and the trials before it are kept."""
        from benchlib.measure import CaseFailed

        limit = round(min(timeout_s, max(self.left(), LEAST_TIMEOUT_S)), 1)
        try:
            return measure(limit)
        except CaseFailed as failed:
            if type(failed) is CaseFailed and limit < timeout_s and failed.reason.startswith("timed out"):
                raise CaseFailed(failed.name, f"{failed.reason} (all the run's --timeout or --budget left it)",
                                 failed.child_traceback, failed.output) from None
            raise

    def share(self, parts: int) -> "Deadline":
        """The deadline of the next of `parts` equal shares of the time left (the first of several cases)."""
        if self.at is None:
            return self
        return Deadline(self.clock() + max(self.left(), 0.0) / max(parts, 1), self.clock)


class TrialStopping:
    """Which unit (an engine of a case, say) runs its next trial: each stops by `stop_reason` on its
    headline figure, or at the deadline once its next trial, at its mean duration so far, would end past it.
    `stopped` holds every unit that stopped, with its reason; `stop_facts(unit)` the facts a `trials_run` record keeps."""

    def __init__(self, *, precision: float, max_trials: int, deadline: Deadline | None = None):
        self.precision, self.max_trials = precision, max_trials
        self.deadline = deadline or Deadline()
        self.figures: dict[Hashable, list[float]] = {}
        self.durations: dict[Hashable, list[float]] = {}
        self.stopped: dict[Hashable, str] = {}

    def now(self) -> float:
        """The deadline's clock: trials are timed by it, so their durations and the time left agree."""
        return self.deadline.clock()

    def affords(self, unit: Hashable) -> bool:
        """Whether `unit`'s next trial fits in the time left (its own mean duration, else every unit's);
        when not, the unit stops as `budget`."""
        if unit in self.stopped:
            return False
        own = self.durations.get(unit) or [d for durations in self.durations.values() for d in durations]
        expected = float(np.mean(own)) if own else 0.0
        if self.deadline.left() >= expected and self.deadline.left() > 0:
            return True
        self.stopped[unit] = BUDGET
        return False

    def add(self, unit: Hashable, figure: float, seconds: float) -> str | None:
        """One trial's headline figure and duration; the reason `unit` stops now, or None."""
        self.figures.setdefault(unit, []).append(float(figure))
        self.durations.setdefault(unit, []).append(float(seconds))
        reason = stop_reason(self.figures[unit], precision=self.precision, max_trials=self.max_trials)
        if reason is not None:
            self.stopped[unit] = reason
        return reason

    def stop_facts(self, unit: Hashable) -> dict:
        """trials run, why they stopped, and the relative half-width of the headline's interval they reached."""
        figures = self.figures.get(unit, [])
        reached = relative_half_width(figures) if len(figures) > 1 else math.nan
        return {"trials_run": len(figures), "stop": self.stopped.get(unit, MAX_TRIALS), "precision": self.precision,
                "precision_reached": reached}
