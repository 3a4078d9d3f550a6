"""The verdict logic on synthetic samples: identical, shifted, noisy, too small, bad input."""

import math

import numpy as np
import pytest

from benchlib.workloads.verdicts import (
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
        (lambda: compare_times([1.0], [0.0, 1.0]), "positive"),
        (lambda: compare_times([1.0] * 5, [1.0] * 5, alpha=1.5), "alpha"),
        (lambda: compare_times([1.0] * 5, [1.0] * 5, min_effect=-0.1), "min_effect"),
    ],
)
def test_bad_input_is_refused_with_what_is_valid(call, message):
    with pytest.raises(ValueError, match=message):
        call()
