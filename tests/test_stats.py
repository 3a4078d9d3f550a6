"""The verdict logic on synthetic samples: identical, shifted, noisy, too small, bad input."""

import math

import numpy as np
import pytest

from benchlib.analysis.stats import (
    DIFFER,
    SAME,
    UNTESTABLE,
    compare_counts,
    compare_times,
    smallest_p_value,
)


def test_identical_deterministic_counts_are_the_same_and_one_allocation_more_differs():
    assert compare_counts([329, 329, 329], [329, 329]).verdict == SAME
    verdict = compare_counts([419, 419, 419], [329, 329, 329])
    assert verdict.verdict == DIFFER
    assert verdict.difference == -90 and verdict.jitter == 0
    assert compare_counts([10, 10], [11, 11]).verdict == DIFFER


def test_counts_within_the_trackers_jitter_are_the_same_and_beyond_it_differ():
    jittery = [100, 102, 101, 100]  # range 2
    assert compare_counts(jittery, [101, 102, 102]).verdict == SAME
    assert compare_counts(jittery, [104, 104, 104]).verdict == DIFFER
    # a jitter measured elsewhere (e.g. on warm calls) widens single first-call samples
    assert compare_counts([100], [103], jitter=3).verdict == SAME
    assert compare_counts([100], [104], jitter=3).verdict == DIFFER


def test_counts_compare_by_their_floor_so_a_traced_call_with_extras_does_not_shift_them():
    verdict = compare_counts([104, 96, 96], [96, 96, 96])  # memray's first traced call after untraced ones
    assert (verdict.floor_a, verdict.floor_b, verdict.jitter) == (96, 96, 8)
    assert verdict.verdict == SAME


def test_identical_time_samples_are_the_same():
    rng = np.random.default_rng(1)
    sample = list(rng.lognormal(np.log(20e-6), 0.05, size=30))
    verdict = compare_times(sample, sample)
    assert verdict.verdict == SAME and verdict.ratio == 1.0
    assert compare_times([1e-3] * 10, [1e-3] * 10).p_value == 1.0


def test_a_clear_shift_in_time_differs():
    rng = np.random.default_rng(2)
    initial = rng.lognormal(np.log(25.7e-6), 0.03, size=30)  # the seed's 25.7 µs against 19.3 µs
    new = rng.lognormal(np.log(19.3e-6), 0.03, size=30)
    verdict = compare_times(initial, new)
    assert verdict.verdict == DIFFER
    assert verdict.p_value < 0.01 and verdict.ratio == pytest.approx(19.3 / 25.7, rel=0.03)


def test_a_significant_but_tiny_shift_is_the_same():
    rng = np.random.default_rng(3)
    a = rng.normal(100.0, 0.1, size=200)
    b = a * 1.01  # 1 %: certain by the rank test, below the 5 % effect
    verdict = compare_times(a, b)
    assert verdict.p_value < 1e-6
    assert verdict.verdict == SAME
    assert compare_times(a, b, min_effect=0.005).verdict == DIFFER


def test_noise_larger_than_the_shift_is_the_same():
    rng = np.random.default_rng(4)
    a = rng.lognormal(np.log(1e-3), 0.5, size=10)
    b = rng.lognormal(np.log(1.06e-3), 0.5, size=10)
    verdict = compare_times(a, b)
    assert verdict.p_value >= 0.01
    assert verdict.verdict == SAME


def test_samples_too_small_to_reach_alpha_are_untestable_not_the_same():
    assert smallest_p_value(1, 1) == 1.0
    assert smallest_p_value(4, 4) == pytest.approx(2 / 70)
    assert smallest_p_value(5, 5) == pytest.approx(2 / 252)
    verdict = compare_times([1e-3, 1e-3, 1e-3, 1e-3], [5e-3, 5e-3, 5e-3, 5e-3])
    assert verdict.verdict == UNTESTABLE and math.isnan(verdict.p_value)
    assert compare_times([1.0, 1.1, 1.2, 1.3, 1.4], [5.0, 5.1, 5.2, 5.3, 5.4]).verdict == DIFFER


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: compare_counts([], [1]), "empty"),
        (lambda: compare_counts([1, float("nan")], [1]), "non-finite"),
        (lambda: compare_counts([1], [1], jitter=-1), "jitter"),
        (lambda: compare_times([1.0], [-1e-3, 1.0]), ">= 0"),
        (lambda: compare_times([1.0] * 5, [1.0] * 5, alpha=1.5), "alpha"),
        (lambda: compare_times([1.0] * 5, [1.0] * 5, min_effect=-0.1), "min_effect"),
    ],
)
def test_bad_input_is_refused_with_what_is_valid(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- intervals, judge, noise flags, interleaving ---------------------------------------------

from benchlib.analysis.stats import (  # noqa: E402
    BETTER,
    INCONCLUSIVE,
    WORSE,
    interleaved_order,
    judge,
    noise_flags,
    ratio_of_medians,
    robust_outliers,
)


def test_a_distribution_shifted_up_is_worse_and_its_ratio_interval_excludes_one():
    rng = np.random.default_rng(1)
    a = 1.0 + 0.02 * rng.standard_normal(20)
    b = 1.3 * a[::-1]
    assert judge(a, b) == WORSE
    assert judge(b, a) == BETTER
    assert judge(a, b, lower_is_better=False) == BETTER  # throughput: higher is better
    interval = ratio_of_medians(a, b)
    assert interval.ci_low > 1.2 and interval.ci_high < 1.4
    assert interval.ci_low <= interval.ratio <= interval.ci_high


def test_equal_distributions_are_the_same_and_their_interval_covers_one():
    a = np.linspace(1.0, 1.1, 15)
    assert judge(a, a[::-1]) == SAME
    interval = ratio_of_medians(a, a[::-1])
    assert interval.ratio == 1.0 and interval.ci_low < 1 < interval.ci_high


def test_two_samples_of_one_value_each_are_inconclusive_not_same():
    assert judge([1.0], [1.0]) == INCONCLUSIVE
    assert judge([1.0], [2.0]) == INCONCLUSIVE


def test_the_bootstrap_interval_is_reproducible_from_its_seed():
    a, b = [1.0, 1.2, 0.9, 1.1, 1.05], [2.0, 2.2, 1.8, 2.5, 2.1]
    assert ratio_of_medians(a, b, seed=3) == ratio_of_medians(a, b, seed=3)
    with pytest.raises(ValueError, match="positive"):
        ratio_of_medians([0.0, 1.0], b)


def test_a_planted_stall_is_flagged_as_an_outlier_and_a_steady_sample_is_not():
    gflops = [13.7, 13.6, 13.9, 13.8, 0.26, 13.7, 13.5]
    assert robust_outliers(gflops).tolist() == [False] * 4 + [True] + [False] * 2
    flags = noise_flags(gflops)
    assert any("outliers 0.26" in flag for flag in flags)
    assert any("max/min" in flag for flag in flags)
    assert noise_flags([13.7, 13.6, 13.9, 13.8, 13.7]) == []


def test_load_above_the_core_count_is_flagged_only_when_recorded():
    steady = [1.0, 1.01, 0.99]
    assert noise_flags(steady, load_average=3.5, cores=2) == ["load average 3.50 at start > 2 cores"]
    assert noise_flags(steady, load_average=1.5, cores=2) == []
    assert noise_flags(steady) == []


def test_interleaving_alternates_without_a_seed_and_is_reproducible_from_one():
    assert interleaved_order(["A", "B"], 3) == ["A", "B"] * 3
    order = interleaved_order(["A", "B", "C"], 4, seed=7)
    assert order == interleaved_order(["A", "B", "C"], 4, seed=7)
    assert all(sorted(order[i:i + 3]) == ["A", "B", "C"] for i in range(0, 12, 3))
    assert any(interleaved_order(["A", "B", "C"], 4, seed=s) != order for s in range(8, 12))
    with pytest.raises(ValueError, match="distinct"):
        interleaved_order(["A", "A"], 2)


def test_a_line_fit_recovers_an_exact_slope_and_its_interval_covers_a_noisy_one():
    from benchlib.analysis.stats import linear_fit

    exact = linear_fit([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0])
    assert (exact.slope, exact.intercept, exact.n, exact.x_low, exact.x_high) == pytest.approx((2.0, 1.0, 4, 0, 3))
    assert exact.ci_low == pytest.approx(2.0) and exact.ci_high == pytest.approx(2.0)
    rng = np.random.default_rng(0)
    x = np.repeat([1e5, 2e5, 4e5], 10)
    noisy = linear_fit(x, 0.01 + 3e-7 * x + rng.normal(0, 1e-3, x.size))
    assert noisy.ci_low < 3e-7 < noisy.ci_high and noisy.ci_high - noisy.ci_low < 1e-7
    with pytest.raises(ValueError, match="two x values"):
        linear_fit([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="same length"):
        linear_fit([1, 2, 3], [1, 2])


def test_a_robust_line_fit_ignores_one_burst_that_moves_least_squares():
    from benchlib.analysis.stats import linear_fit

    x = np.repeat([4e5, 4.6e5, 5.2e5, 6.4e5], 5)
    y = 0.1 + 1e-7 * x
    y[10] += 0.06  # one pause caught by another process
    robust, least = linear_fit(x, y, robust=True), linear_fit(x, y)
    assert robust.method == "Theil-Sen" and robust.slope == pytest.approx(1e-7) and robust.ci_low <= 1e-7 <= robust.ci_high
    assert abs(least.slope - 1e-7) > 5e-9 and least.ci_high - least.ci_low > 1e-7 > 100 * (robust.ci_high - robust.ci_low)
