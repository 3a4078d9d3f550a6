"""Statistics on samples of one measurement: do two cases really differ, how sure is a ratio, is it noisy?

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
    if np.any(sample_a < 0) or np.any(sample_b < 0):
        raise ValueError("times must be >= 0 (seconds; a GC pause that did not happen is 0)")
    median_a, median_b = float(np.median(sample_a)), float(np.median(sample_b))
    if smallest_p_value(sample_a.size, sample_b.size) >= alpha:
        return TimeVerdict(UNTESTABLE, median_a, median_b, math.nan, alpha, min_effect)
    if np.ptp(np.concatenate([sample_a, sample_b])) == 0:
        p_value = 1.0  # every value tied: no evidence of a difference (scipy would return nan)
    else:
        from scipy.stats import mannwhitneyu  # scipy.stats takes ~0.4 s to import: only where a test is made

        p_value = float(mannwhitneyu(sample_a, sample_b, alternative="two-sided").pvalue)
    effect = abs(median_b / median_a - 1.0) if median_a > 0 else (math.inf if median_b > 0 else 0.0)
    verdict = DIFFER if p_value < alpha and effect >= min_effect else SAME
    return TimeVerdict(verdict, median_a, median_b, p_value, alpha, min_effect)


# --- intervals, noise flags and interleaving -------------------------------------------------

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
MAX_CV = 0.10  # pyperf warns above a 10% standard deviation relative to the mean
MAX_SPREAD = 1.5  # max/min of repeated timings beyond which a sample is too noisy to trust
BETTER, WORSE, INCONCLUSIVE = "better", "worse", "inconclusive"
MAD_OUTLIER_Z = 5.0  # robust z (median/MAD scaled to a normal sigma) beyond which a value is an outlier
# ...and it must also lie this far from the median, relative to it: with a tiny MAD (steady trials)
# a value 3% off would otherwise count as an outlier
MIN_OUTLIER_DEVIATION = 0.2


@dataclass(frozen=True)
class RatioInterval:
    """median(b) / median(a) with a percentile-bootstrap interval over the trials of each side."""

    ratio: float
    ci_low: float
    ci_high: float
    confidence: float

    def __str__(self) -> str:
        return f"{self.ratio:.3g} [{self.ci_low:.3g}, {self.ci_high:.3g}] ({self.confidence:.0%})"


def ratio_of_medians(a: Sequence[float], b: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE,
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> RatioInterval:
    """Interval of median(b)/median(a): each side resampled independently, with a fixed seed.

    One trial per side gives no spread to resample, so its interval is the point itself only when
    both values are exact; callers must read a one-trial interval as "not measured", not as certain.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples!r}")
    sample_a, sample_b = _sample(a, "a"), _sample(b, "b")
    if np.any(sample_a <= 0):
        raise ValueError("a must hold positive values: it is the denominator of the ratio")
    rng = np.random.default_rng(seed)
    medians_a = np.median(rng.choice(sample_a, size=(resamples, sample_a.size)), axis=1)
    medians_b = np.median(rng.choice(sample_b, size=(resamples, sample_b.size)), axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians_b / medians_a, [tail, 100 - tail])
    ratio = float(np.median(sample_b) / np.median(sample_a))
    return RatioInterval(ratio, float(low), float(high), confidence)


def judge(a: Sequence[float], b: Sequence[float], *, lower_is_better: bool = True,
          alpha: float = DEFAULT_ALPHA, min_effect: float = DEFAULT_MIN_EFFECT) -> str:
    """"better", "worse" or "same" for b against a, or "inconclusive" when the test cannot decide.

    The rule is `compare_times`: Mann-Whitney U significance *and* a minimum relative effect;
    samples too small for the test ever to reach alpha are "inconclusive", never "same".
    """
    verdict = compare_times(a, b, alpha=alpha, min_effect=min_effect)
    if verdict.verdict == UNTESTABLE:
        return INCONCLUSIVE
    if verdict.verdict == SAME:
        return SAME
    b_is_lower = verdict.median_b < verdict.median_a
    return BETTER if b_is_lower == lower_is_better else WORSE



def robust_outliers(values: Sequence[float], *, z: float = MAD_OUTLIER_Z) -> np.ndarray:
    """Mask of values whose distance from the median exceeds z robust sigmas (1.4826 * MAD).

    With a MAD of zero (most values identical) any value off the median is an outlier.
    """
    sample = _sample(values, "values")
    median = np.median(sample)
    sigma = 1.4826 * np.median(np.abs(sample - median))
    if sigma == 0:
        return sample != median
    return np.abs(sample - median) > z * sigma


def noise_flags(values: Sequence[float], *, load_average: float | None = None, cores: int | None = None,
                max_cv: float = MAX_CV, max_spread: float = MAX_SPREAD) -> list[str]:
    """Reasons, pyperf style, not to trust repeated values of one measurement (empty when none).

    Spread: coefficient of variation above `max_cv` or max/min above `max_spread`; a robust
    outlier at least `MIN_OUTLIER_DEVIATION` from the median; a load average at start above the core count, when both were recorded.
    """
    sample = _sample(values, "values")
    flags = []
    if sample.size >= 2:
        mean = float(np.mean(sample))
        cv = float(np.std(sample, ddof=1) / mean) if mean > 0 else math.inf
        if cv > max_cv:
            flags.append(f"coefficient of variation {cv:.0%} > {max_cv:.0%}")
        low, high = float(np.min(sample)), float(np.max(sample))
        if low > 0 and high / low > max_spread:
            flags.append(f"max/min {high / low:.3g} > {max_spread:g}")
    if sample.size >= 3:
        median = np.median(sample)
        far = np.abs(sample - median) > MIN_OUTLIER_DEVIATION * abs(median)
        outliers = sample[robust_outliers(sample) & far]
        if outliers.size:
            flags.append(f"outliers {', '.join(f'{v:.3g}' for v in outliers)} (median {np.median(sample):.3g})")
    if load_average is not None and cores is not None and load_average > cores:
        flags.append(f"load average {load_average:.2f} at start > {cores} cores")
    return flags


def interleaved_order(alternatives: Sequence[str], trials: int, *, seed: int | None = None) -> list[str]:
    """The order to run `trials` rounds of every alternative in, so drift falls on all alike.

    Without a seed the rounds alternate A B A B; with one each round is shuffled by that seed,
    so the same seed gives the same order (record the seed, or the order itself, with the run).
    """
    names = list(alternatives)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"alternatives must be distinct and non-empty, got {names!r}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials!r}")
    if seed is None:
        return names * trials
    rng = np.random.default_rng(seed)
    return [names[i] for _ in range(trials) for i in rng.permutation(len(names))]


def median_interval(values: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE,
                    resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> RatioInterval:
    """The median of `values` (e.g. one slope per trial) with its percentile-bootstrap interval."""
    sample = _sample(values, "values")
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(sample, size=(resamples, sample.size)), axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return RatioInterval(float(np.median(sample)), float(low), float(high), confidence)


@dataclass(frozen=True)
class LinearFit:
    """A line `y = intercept + slope * x` with the slope's confidence interval: how much each extra
    unit of x costs, and how sure that is. `method` says how it was fitted; `x_low` and `x_high`
    bound the x it was fitted over, where the line holds."""

    slope: float
    intercept: float
    ci_low: float
    ci_high: float
    confidence: float
    n: int
    x_low: float
    x_high: float
    method: str = "least squares"


def linear_fit(x: Sequence[float], y: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE,
               robust: bool = False) -> LinearFit:
    """Fit `y` against `x`; needs three points or more and two distinct x values. Least squares with
    Student's t on the slope's standard error, or with `robust` the Theil-Sen estimator (the median
    of the pairwise slopes, with its interval): one timing caught by another process's burst on a
    shared machine moves a least-squares slope, not a median."""
    from scipy.stats import linregress, t, theilslopes

    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    xs, ys = _sample(x, "x"), _sample(y, "y")
    if xs.size != ys.size:
        raise ValueError(f"x and y must have the same length, got {xs.size} and {ys.size}")
    if xs.size < 3 or np.unique(xs).size < 2:
        raise ValueError(f"a line needs three points or more at two x values at least, got {xs.size} points "
                         f"at {np.unique(xs).size} x value(s)")
    if robust:
        slope, intercept, low, high = theilslopes(ys, xs, alpha=confidence)
        return LinearFit(float(slope), float(intercept), float(low), float(high), confidence, int(xs.size),
                         float(xs.min()), float(xs.max()), "Theil-Sen")
    fit = linregress(xs, ys)
    half = float(t.ppf(0.5 + confidence / 2, xs.size - 2) * fit.stderr)
    return LinearFit(float(fit.slope), float(fit.intercept), float(fit.slope) - half, float(fit.slope) + half,
                     confidence, int(xs.size), float(xs.min()), float(xs.max()))
