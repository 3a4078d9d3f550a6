"""Adaptive trials and the time budget of an engine comparison and of a run, with deterministic figures:
a fake child whose peaks settle, never settle or never change, and a clock that moves only when told."""

import json

import numpy as np
import pytest

from benchlib.report.tables.engine_summary import comparison_text
from benchlib.trials.cases import Cases, compare_engines
from benchlib.engines.gradients import save_gradient
from benchlib.measure.core import Measurement
from benchlib.measure.isolation import IsolatedResult
from benchlib.analysis.seed_verdicts import INCONCLUSIVE, RatioRule, seed_verdicts
from benchlib.trials.stopping import BUDGET, DETERMINISTIC, MAX_TRIALS, PRECISION, Deadline, TrialStopping

PEAKS = {  # each engine's peak per trial: settles, never settles, never changes
    "benchlib-inplace": [1000.0, 1004.0, 998.0, 1001.0, 1000.0, 999.0],
    "torch": [100.0, 150.0, 80.0, 130.0, 60.0, 140.0],
    "manual": [4096.0] * 6,
}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FakeChildren:
    """compare_engines' children, injected as its `isolate`: PEAKS, one value per call of each engine; every
    child advances `clock` by 10 s and is listed in `calls`."""

    def __init__(self):
        self.clock, self.calls = FakeClock(), []

    def __call__(self, target, params, *, name, device, options):
        engine = params["engine"]
        trial = sum(1 for called in self.calls if called == (params["case"], engine))
        self.calls.append((params["case"], engine))
        self.clock.now += 10.0
        save_gradient(np.ones(3), params["gradient_dir"], engine)
        measurement = Measurement(name=name, device="cpu", times_s=(0.01,), gc_count=0, gc_seconds=0.0,
                                  peak_bytes=int(PEAKS[engine][trial % len(PEAKS[engine])]), baseline_bytes=0)
        return IsolatedResult(name, measurement, {}, {"malloc_policy": "glibc-default", "malloc_env": {}})


@pytest.fixture
def fake_children():
    return FakeChildren()


def _compare(children, cases=("a",), deadline=None, **settings):
    engines = ["manual", "benchlib-inplace", "torch"]
    return compare_engines(Cases("b", "nowhere:case", {case: {"case": case} for case in cases}),
                           {"engines": engines, "dtype": "float64", **settings}, device="cpu", progress=None,
                           deadline=deadline, isolate=children)


def _stops(comparison):
    frame = comparison.frame()
    rows = frame[frame["metric"] == "trials_run"]
    return {(row.case, row.variant): (int(row.value), json.loads(row.params)["stop"]) for row in rows.itertuples()}


def test_each_engine_stops_at_its_own_reason_and_says_it(fake_children):
    comparison = _compare(fake_children, trials=6, precision=0.02)
    assert _stops(comparison) == {("a", "manual"): (3, DETERMINISTIC), ("a", "benchlib-inplace"): (3, PRECISION),
                                  ("a", "torch"): (6, MAX_TRIALS)}
    summary = comparison.summary_frame().set_index("engine")
    assert summary.loc["torch", "trials"] == 6 and summary.loc["torch", "stop"] == MAX_TRIALS
    assert "stop" in comparison_text(comparison)


def test_precision_zero_runs_every_trial(fake_children):
    calls = fake_children.calls
    comparison = _compare(fake_children, trials=4, precision=0.0)
    assert len(calls) == 12
    assert set(_stops(comparison).values()) == {(4, MAX_TRIALS)}


def test_a_deadline_shares_the_time_among_cases_and_lists_what_it_could_not_afford(fake_children):
    clock, calls = fake_children.clock, fake_children.calls
    # 45 s for two cases of 10 s children: case a gets 22.5 s (two children), case b the 25 s left (two)
    comparison = _compare(fake_children, cases=("a", "b"), deadline=Deadline(clock.now + 45, clock), trials=6, precision=0.02)
    assert [case for case, _ in calls] == ["a", "a", "b", "b"] and calls[0] == ("a", "manual")
    stops = _stops(comparison)
    assert len(stops) == 4 and {stop for count, stop in stops.values()} == {BUDGET}
    not_run = [(p.case, p.engine) for p in comparison.problems if p.status == "not run"]
    assert len(not_run) == 2 and not set(not_run) & set(calls)  # every engine that never ran is listed
    assert all("budget" in p.message for p in comparison.problems)
    assert comparison.ok  # what the budget left out is listed, not failed
    assert clock.now <= 1000 + 45


def test_the_first_child_runs_even_past_the_deadline_so_there_is_a_baseline(fake_children):
    clock, calls = fake_children.clock, fake_children.calls
    comparison = _compare(fake_children, deadline=Deadline(clock.now - 1, clock), trials=3, precision=0.02)
    assert calls == [("a", "manual")]
    assert [p.engine for p in comparison.problems] == ["benchlib-inplace", "torch"]


def test_trial_stopping_keeps_to_the_deadline_with_the_mean_duration():
    clock = FakeClock()
    stopping = TrialStopping(precision=0.0, max_trials=10, deadline=Deadline(clock.now + 25, clock))
    while stopping.affords("x"):
        clock.now += 10
        stopping.add("x", 1.0 + clock.now, seconds=10)
    assert stopping.stop_facts("x")["trials_run"] == 2 and stopping.stopped["x"] == BUDGET


def test_an_inconclusive_verdict_says_why_and_how_its_trials_stopped(fake_children):
    comparison = _compare(fake_children, trials=6, precision=0.02)
    records = comparison.frame().assign(run_id="r")
    rule = RatioRule("b", "torch needs as much as manual", "peak_bytes", "torch", "manual", 0.025, 0.05)
    (verdict,) = seed_verdicts(records, (rule,)).itertuples()
    assert verdict.verdict == INCONCLUSIVE
    assert "straddles 0.025;" in verdict.reason and "torch 6 trials, max_trials" in verdict.reason
    assert "manual 3 trials, deterministic" in verdict.reason


def test_a_model_files_summary_says_which_engine_the_budget_left_unrun():
    from benchlib.records import make_record, records_frame, status_record
    from benchlib.usermodel.summary import summary_table

    labels = dict(benchmark="m", case="step", device="cpu", dtype="float32")
    records = [make_record(**labels, engine="torch", metric=metric, value=value, params={"trial": 0})
               for metric, value in (("peak_bytes", 4096.0), ("time", 0.5))]
    records.append(make_record(**labels, engine="torch", metric="trials_run", value=1.0,
                               params={"stop": BUDGET, "precision": 0.02, "precision_reached": float("nan")}))
    records.append(status_record(**labels, engine="torch.func", status="not_run", message="the budget ran out"))
    lines = dict(zip(*summary_table(records_frame(records))[["engine", "summary"]].to_dict("list").values()))
    assert lines["torch"].endswith("1 trial (budget)")
    assert lines["torch.func"].split(None, 1)[1] == "not run: the budget ran out"


def test_compare_says_how_each_sides_trials_stopped(fake_children):
    from benchlib.analysis.compare import compare_records

    a = _compare(fake_children, trials=6, precision=0.02).frame()
    b = _compare(fake_children, trials=4, precision=0.0).frame()
    rows = compare_records(a, b, metrics=["peak_bytes"]).set_index("variant")
    assert rows.loc["manual", "stopped"] == "A: 3 trials, deterministic; B: 4 trials, max_trials"
    assert rows.loc["torch", "stopped"] == "A: 6 trials, max_trials; B: 4 trials, max_trials"


def test_identical_closures_lists_the_combinations_the_budget_left_unrun(monkeypatch):
    import time

    from benchlib.workloads.closures import BENCHMARK, protocol
    from benchlib.workloads.closures.spec import STEPS

    monkeypatch.setenv("BENCHLIB_DEADLINE", repr(time.time() - 1))  # spent already: only the first runs
    ran = []
    monkeypatch.setattr(protocol, "run_protocol", lambda mwe, engine, order, **_: ran.append((mwe, engine, order)) or [])
    monkeypatch.setattr(protocol, "tracker_records", lambda *args, **kwargs: [])
    config = BENCHMARK.config()
    records = protocol.run(config, "cpu", progress=None)
    combinations = len(config.mwes) * len(config.engines) * len(config.orders)
    assert ran == [(config.mwes[0], config.engines[0], config.orders[0])]
    assert [r["metric"] for r in records] == ["not_run"] * (combinations - 1) * len(STEPS)


@pytest.mark.slow
def test_the_closures_notebook_draws_what_the_budget_measured_and_names_the_rest(tmp_path, monkeypatch):
    import io
    import time

    from benchlib.records import load_records
    from benchlib.runner import run

    monkeypatch.setenv("BENCHLIB_DEADLINE", repr(time.time() - 1))  # the kernel inherits it: one combination runs
    result = run(["identical_closures"], device="cpu", out=tmp_path, quick=True, progress=False, stream=io.StringIO(),
                 params={"engines": ["torch"], "mwes": ["dense", "reduced"]})
    assert [(r.name, r.status) for r in result.notebooks] == [("identical_closures", "ok")]
    records = load_records(result.path)
    not_run = records[records["metric"] == "not_run"]
    assert set(not_run["case"].str.split("/").str[0]) == {"reduced"} and len(not_run) > 0
    output = (result.path / "notebooks" / "identical_closures.ipynb").read_text()
    assert "reduced MWE: nothing measured" in output
