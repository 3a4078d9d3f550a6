"""Verdicts on two samples of the same measurement: do two cases really differ?

Allocation counts from a tracer are nearly deterministic, so they are compared exactly, widened
only by the jitter the tracer itself shows on identical calls. They are compared by their floor
(the smallest count of identical calls): the tracer's extras, such as the first call traced after
untraced ones (seen with memray), only ever add. Times are noisy and skewed, so they
are compared by a rank test (Mann-Whitney U) *and* a minimum effect size: with many repeats a
rank test flags differences far too small to matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.stats import mannwhitneyu

DIFFER = "differ"
SAME = "same"
UNTESTABLE = "too few samples"

DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.05


@dataclass(frozen=True)
class CountVerdict:
    """Counts of two cases: `verdict` is "differ" when the floors are further apart than the jitter."""

    verdict: str
    floor_a: float
    floor_b: float
    jitter: float

    @property
    def difference(self) -> float:
        return self.floor_b - self.floor_a

    def __str__(self) -> str:
        return (f"{self.verdict}: {self.floor_a:g} vs {self.floor_b:g} "
                f"(difference {self.difference:+g}, jitter {self.jitter:g})")


@dataclass(frozen=True)
class TimeVerdict:
    """Times of two cases: "differ" needs p < alpha and a relative effect of at least min_effect."""

    verdict: str
    median_a: float
    median_b: float
    p_value: float
    alpha: float
    min_effect: float

    @property
    def ratio(self) -> float:
        return self.median_b / self.median_a

    def __str__(self) -> str:
        return (f"{self.verdict}: ratio {self.ratio:.3f} (p = {self.p_value:.2g}, "
                f"needs p < {self.alpha:g} and |ratio - 1| >= {self.min_effect:g})")


def _sample(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    if array.size == 0:
        raise ValueError(f"{name} is empty: a verdict needs at least one value per case")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds non-finite values {array.tolist()}: only finite numbers are valid")
    return array


def compare_counts(a: Sequence[float], b: Sequence[float], *, jitter: float | None = None) -> CountVerdict:
    """Compare allocation counts (or bytes) of two cases.

    The tolerance is the tracer's jitter: by default the larger range of repeated identical calls
    within `a` or within `b` (zero for a deterministic tracer, so the comparison is exact). Pass
    `jitter` to use one measured elsewhere, e.g. for single first-call samples.
    """
    sample_a, sample_b = _sample(a, "a"), _sample(b, "b")
    if jitter is None:
        jitter = float(max(np.ptp(sample_a), np.ptp(sample_b)))
    elif not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"jitter must be a finite number >= 0, got {jitter!r}")
    floor_a, floor_b = float(np.min(sample_a)), float(np.min(sample_b))
    verdict = DIFFER if abs(floor_b - floor_a) > jitter else SAME
    return CountVerdict(verdict, floor_a, floor_b, float(jitter))


def smallest_p_value(n_a: int, n_b: int) -> float:
    """The smallest two-sided p an exact Mann-Whitney U test can give for these sample sizes."""
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def compare_times(a: Sequence[float], b: Sequence[float], *, alpha: float = DEFAULT_ALPHA,
                  min_effect: float = DEFAULT_MIN_EFFECT) -> TimeVerdict:
    """Compare times of two cases by a two-sided Mann-Whitney U test plus a minimum effect.

    Samples too small for the test ever to reach `alpha` get the verdict "too few samples"
    rather than a "same" that the data could never have contradicted.
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if not min_effect >= 0:
        raise ValueError(f"min_effect must be >= 0, got {min_effect!r}")
    sample_a, sample_b = _sample(a, "a"), _sample(b, "b")
    if np.any(sample_a <= 0) or np.any(sample_b <= 0):
        raise ValueError("times must be positive (seconds)")
    median_a, median_b = float(np.median(sample_a)), float(np.median(sample_b))
    if smallest_p_value(sample_a.size, sample_b.size) >= alpha:
        return TimeVerdict(UNTESTABLE, median_a, median_b, math.nan, alpha, min_effect)
    if np.ptp(np.concatenate([sample_a, sample_b])) == 0:
        p_value = 1.0  # every value tied: no evidence of a difference (scipy would return nan)
    else:
        p_value = float(mannwhitneyu(sample_a, sample_b, alternative="two-sided").pvalue)
    effect = abs(median_b / median_a - 1.0)
    verdict = DIFFER if p_value < alpha and effect >= min_effect else SAME
    return TimeVerdict(verdict, median_a, median_b, p_value, alpha, min_effect)
