"""When a case stops: deterministic sequences of figures that settle, never settle, or never change."""

import pytest

from benchlib.trials.stopping import DETERMINISTIC, MAX_TRIALS, PRECISION, Deadline, relative_half_width, stop_reason


def stops_after(sequence, **rule):
    """The trials run, and why they stopped, feeding `sequence` one trial at a time."""
    for n in range(1, len(sequence) + 1):
        reason = stop_reason(sequence[:n], **rule)
        if reason is not None:
            return n, reason
    return None


def test_a_figure_that_settles_stops_at_the_precision():
    settling = [1000.0, 1004.0, 998.0, 1001.0, 1000.0, 999.0]
    assert stops_after(settling, precision=0.02, max_trials=6) == (3, PRECISION)
    assert stops_after(settling, precision=0.001, max_trials=6) == (6, MAX_TRIALS)  # tighter than it gets


def test_a_figure_that_never_settles_runs_to_the_cap():
    assert stops_after([100.0, 150.0, 80.0, 130.0, 60.0], precision=0.02, max_trials=5) == (5, MAX_TRIALS)


def test_an_identical_figure_stops_as_deterministic_and_precision_zero_asks_for_every_trial():
    assert stops_after([4096.0] * 5, precision=0.02, max_trials=5) == (3, DETERMINISTIC)
    assert stops_after([4096.0] * 5, precision=0.0, max_trials=5) == (5, MAX_TRIALS)


def test_two_trials_are_never_an_interval_and_a_low_cap_stops_there():
    assert stop_reason([100.0, 100.0], precision=0.02, max_trials=5) is None
    assert stops_after([100.0, 101.0], precision=0.02, max_trials=2) == (2, MAX_TRIALS)
    assert stops_after([1.0, 2.0, 1.0, 1.0], precision=0.0, max_trials=4) == (4, MAX_TRIALS)  # 0: every trial


def test_the_precision_reached_is_the_median_intervals_relative_half_width():
    assert relative_half_width([100.0, 100.0, 100.0]) == 0.0
    assert relative_half_width([100.0, 102.0, 101.0]) == pytest.approx(0.0099, abs=1e-3)
    assert relative_half_width([0.0, 0.0, 0.0]) == 0.0


def test_a_case_is_given_no_more_time_than_the_deadline_leaves_and_its_timeout_says_why():
    from benchlib.measure import CaseCapped, CaseFailed

    clock = [1000.0]
    deadline, given = Deadline(1030.0, clock=lambda: clock[0]), []

    def hangs(limit):
        given.append(limit)
        raise CaseFailed("m/step/slow", f"timed out after {limit:g} s; the child was killed")

    with pytest.raises(CaseFailed, match=r"timed out after 30 s; .* \(all the run's --timeout or --budget left it\)"):
        deadline.within(hangs, 600)
    clock[0] = 1040.0  # past it: the first child still runs, and fails at once, named
    with pytest.raises(CaseFailed):
        deadline.within(hangs, 600)
    assert given == [30.0, 1.0]
    with pytest.raises(CaseFailed) as plain:  # no deadline: the case's own timeout, said as it was
        Deadline(None).within(hangs, 600)
    assert given[-1] == 600 and "left it" not in plain.value.reason
    with pytest.raises(CaseCapped):  # any other failure goes on as it was
        deadline.within(lambda limit: (_ for _ in ()).throw(CaseCapped("m", 10, 5)), 600)
    assert Deadline(1030.0, clock=lambda: 1000.0).within(lambda limit: limit, 20) == 20  # its own timeout comes first
