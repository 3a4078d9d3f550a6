"""The one trial loop: its order, and the same records whatever runs through it."""

from benchlib.trials import trial_order
from benchlib.analysis.engine_summary import Problem

MANUAL_FIRST = "manual".__eq__  # the reference opens the first round


def test_trial_order_runs_every_engine_once_per_round_manual_first_and_is_reproducible_from_its_seed():
    engines = ["torch", "autograd", "manual", "benchlib-inplace"]
    order = trial_order(engines, 4, seed=7, opens=MANUAL_FIRST)
    assert order == trial_order(engines, 4, seed=7, opens=MANUAL_FIRST)
    assert order[0] == (0, "manual")
    rounds = [[name for trial, name in order if trial == t] for t in range(4)]
    assert all(sorted(names) == sorted(engines) for names in rounds)
    assert len({tuple(names) for names in rounds[1:]}) > 1  # shuffled, not one fixed order
    assert [name for _, name in trial_order(["torch", "manual"], 2, seed=None, opens=MANUAL_FIRST)] == ["manual", "torch", "torch", "manual"]


def _fake_result(engine, gradient_dir, peak=100, checks=None):
    import numpy as np

    from benchlib.engines.gradients import save_gradient
    from benchlib.measure.core import Measurement
    from benchlib.measure.isolation import IsolatedResult

    save_gradient(np.ones(2) * (2.0 if engine == "wrong" else 1.0), gradient_dir, engine)
    measurement = Measurement(name=engine, device="cpu", times_s=(0.01,), gc_count=0, gc_seconds=0.0,
                              peak_bytes=peak, baseline_bytes=0)
    return IsolatedResult(engine, measurement, dict(checks or {}), {"isolation": "fork", "ignored": 1})


def _units(groups, engines):
    from benchlib.trials import Unit

    return [Unit(group=group, engine=engine, name=f"b {group}", params={"p": 1}, trial_params={"tp": 2},
                 labels=dict(benchmark="b", case=group, engine=engine, device="cpu", dtype="float64"))
            for group in groups for engine in engines]


def test_one_loop_checks_each_groups_gradients_against_its_own_reference_and_records_every_outcome():
    import json

    from benchlib.measure import CaseFailed
    from benchlib.trials import TrialLoop, TrialSettings

    calls, lines = [], []

    def measure(unit, trial, gradient_dir):
        calls.append((unit.group, unit.engine, trial))
        if unit.engine == "broken" or (unit.group, unit.engine) == ("g2", "manual"):
            raise CaseFailed(unit.engine, "it raised")
        stochastic = unit.group == "g3" and unit.engine == "manual"  # its gradient changes with the seed
        return _fake_result(unit.engine, gradient_dir, checks={"grad_seed_dependent": 1.0} if stochastic else None)

    loop = TrialLoop(TrialSettings(trials=3, precision=0.0, order_seed=1, reference="manual"), lines.append)
    loop.run(_units(["g1", "g2", "g3"], ["manual", "wrong", "broken"]), measure)
    # both references open the first round; a failure is tried once, its later trials skipped
    assert {call[:2] for call in calls[:3]} == {("g1", "manual"), ("g2", "manual"), ("g3", "manual")}
    assert calls.count(("g1", "broken", 0)) == 1 and not any(c[:2] == ("g1", "broken") and c[2] > 0 for c in calls)
    by = {}
    for record in loop.records:
        by.setdefault((record["case"], record["variant"], record["metric"]), []).append(record)
    # against g1's manual: off by 100%, not the same maths: measured, kept, failed, not tried again
    assert [r["value"] for r in by["g1", "wrong", "grad_max_rel_err"]] == [1.0]
    assert len(by["g1", "wrong", "time"]) == 1 and ("g1", "wrong", "trials_run") not in by
    assert ("g2", "wrong", "grad_max_rel_err") not in by
    assert len(by["g2", "wrong", "grad_check_unavailable"]) == 3  # g2's manual failed: said, never compared
    # g3's reference is stochastic: the same 100% is "not comparable", neither a pass nor a failure
    unchecked = [json.loads(r["params"])["message"] for r in by["g3", "wrong", "grad_check_unavailable"]]
    assert len(unchecked) == 3 and all(m.startswith("not comparable: the step is stochastic") for m in unchecked)
    assert [r["value"] for r in by["g3", "wrong", "grad_max_rel_err"]] == [1.0] * 3  # recorded, not judged
    assert by["g3", "wrong", "trials_run"][0]["value"] == 3.0
    assert by["g1", "manual", "trials_run"][0]["value"] == 3.0
    failed = {(p.case, p.engine): p.message for p in loop.problems if p.status == "failed"}
    assert set(failed) == {("g1", "broken"), ("g1", "wrong"), ("g2", "manual"), ("g2", "broken"), ("g3", "broken")}
    assert "past the float64 tolerance 1e-10: not the same maths" in failed["g1", "wrong"]
    params = json.loads(by["g1", "wrong", "peak_bytes"][0]["params"])
    assert params["p"] == 1 and params["tp"] == 2 and params["isolation"] == "fork" and "ignored" not in params
    assert "trial" in params and "position" in params
    assert any("gradient not checked" in line for line in lines)


def test_a_child_that_says_its_engine_cannot_run_the_code_is_not_applicable_not_failed():
    from benchlib.measure import CaseNotApplicable
    from benchlib.trials import TrialLoop, TrialSettings

    def measure(unit, trial, gradient_dir):
        if unit.engine == "torch.func":
            raise CaseNotApplicable(unit.engine, "torch.func cannot transform this step: because")
        return _fake_result(unit.engine, gradient_dir)

    loop = TrialLoop(TrialSettings(trials=2, precision=0.0, order_seed=None, reference="manual"), None)
    loop.run(_units(["g"], ["manual", "torch.func"]), measure)
    assert loop.problems == [Problem("g", "torch.func", "not applicable", "torch.func cannot transform this step: because")]
    assert [r["metric"] for r in loop.records if r["variant"] == "torch.func"] == ["not_applicable"]


def test_the_loop_lists_what_the_deadline_left_unrun_and_always_runs_the_first_child():
    from benchlib.trials import Deadline, TrialLoop, TrialSettings

    calls = []

    def measure(unit, trial, gradient_dir):
        calls.append(unit.engine)
        return _fake_result(unit.engine, gradient_dir)

    loop = TrialLoop(TrialSettings(trials=2, precision=0.0, order_seed=None, reference="manual"), None)
    loop.run(_units(["g"], ["torch", "manual"]), measure, deadline=Deadline(at=0.0))
    assert calls == ["manual"]
    assert [(p.engine, p.status) for p in loop.problems] == [("torch", "not run")]
    assert [r["metric"] for r in loop.records if r["variant"] == "torch"] == ["not_run"]


def test_the_same_gradient_with_another_optimizer_step_is_not_applicable_and_its_figures_are_not_kept():
    from benchlib.engines.gradients import UPDATE_ERROR_METRIC
    from benchlib.trials import TrialLoop, TrialSettings

    def measure(unit, trial, gradient_dir):  # a regrouping step's child judges its update against the file's own
        return _fake_result(unit.engine, gradient_dir, checks={UPDATE_ERROR_METRIC: 2.0} if unit.engine == "fused"
                            else {})

    from dataclasses import replace

    units = [replace(unit, regroups_optimizer="it steps each parameter alone") if unit.engine == "fused" else unit
             for unit in _units(["g"], ["manual", "fused", "same"])]
    loop = TrialLoop(TrialSettings(trials=2, precision=0.0, order_seed=None, reference="manual"), None)
    loop.run(units, measure)
    problems = {p.engine: (p.status, p.message) for p in loop.problems}
    assert list(problems) == ["fused"] and problems["fused"][0] == "not applicable"
    assert "the update its optimizer step makes differs by 2 from the file's optimizer step on the same gradient" \
        in problems["fused"][1]
    assert [r["metric"] for r in loop.records if r["variant"] == "fused"] == ["not_applicable"]
    assert not [r for r in loop.records if r["metric"] == UPDATE_ERROR_METRIC]  # "same" steps the file's optimizer
    # an engine that does not regroup the optimizer and makes another step is wrong, not inapplicable
    loop = TrialLoop(TrialSettings(trials=2, precision=0.0, order_seed=None, reference="manual"), None)
    loop.run(_units(["g"], ["manual", "fused"]), measure)
    assert [(p.engine, p.status) for p in loop.problems] == [("fused", "failed")]
    assert "not the same step" in loop.problems[0].message


def test_an_engine_measured_then_failed_is_one_row_in_the_summary_and_it_reads_failed():
    from benchlib.records import make_record
    from benchlib.trials.cases import EngineComparison

    labels = dict(benchmark="b", case="c", device="cpu", dtype="float64")
    records = [make_record(**labels, engine=engine, metric=metric, value=value, params={"trial": 0})
               for engine in ("manual", "torch") for metric, value in (("time", 1.0), ("peak_bytes", 100.0))]
    comparison = EngineComparison("b", "cpu", "float64", records=records,
                                  problems=[Problem("c", "torch", "failed", "not the same maths")])
    summary = comparison.summary_frame().set_index("engine")
    assert list(summary.index) == ["manual", "torch"]
    assert summary.loc["torch", "status"] == "failed" and summary.loc["torch", "reason"] == "not the same maths"
