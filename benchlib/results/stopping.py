"""When a case has run enough trials: its headline figure settled within a stated precision, or
identical across trials (an exact count or size), or the cap on trials reached. The reason is kept
as data (`trials_run` records), so every number says why it stopped where it did."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchlib.results.stats import median_interval

PRECISION, DETERMINISTIC, MAX_TRIALS = "precision", "deterministic", "max_trials"
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
    if values.size >= min_trials:
        if np.all(values == values[0]):
            return DETERMINISTIC
        if precision > 0 and relative_half_width(values) <= precision:
            return PRECISION
    return MAX_TRIALS if values.size >= max_trials else None
