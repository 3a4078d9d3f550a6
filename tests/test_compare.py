"""`benchlib compare` on two small runs written by the test: the same runs pass, a slower engine fails."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchlib.records import Run, make_record
from benchlib.analysis.compare import compare_records, compare_runs
from benchlib.analysis.stats import compare_times
from benchlib.runner.cli import main

TIMES = np.linspace(1.0, 1.1, 12)


def _write_run(root, name, slow_factor=1.0):
    """Twelve trials of each engine's time, and its peak (exact) in each."""
    run = Run.create(root / name, "cpu")
    records = []
    for engine, factor in (("ours", slow_factor), ("torch", 1.0)):
        for trial, seconds in enumerate(TIMES):
            for metric, value, unit in (("time", seconds * factor, "s"), ("peak_bytes", 1000.0, "B")):
                records.append(make_record(benchmark="dot_chain", case="n=4", engine=engine, device="cpu",
                                           dtype="float64", metric=metric, value=value, unit=unit,
                                           params={"trial": trial}))
    run.save_records(records, "dot_chain")
    return run.path


@pytest.mark.slow  # its run's environment asks git for the commit
def test_the_same_run_twice_is_same_and_exits_zero(tmp_path, capsys):
    a, b = _write_run(tmp_path, "a"), _write_run(tmp_path, "b")
    table = compare_runs(a, b)
    assert table.set_index(["variant", "metric"])["label"].to_dict() == {
        ("ours", "time"): "same", ("ours", "peak_bytes"): "same",
        ("torch", "time"): "same", ("torch", "peak_bytes"): "same"}
    assert main(["compare", str(a), str(b)]) == 0


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_slower_engine_exits_one_naming_engine_and_metric(tmp_path, capsys):
    a, b = _write_run(tmp_path, "a"), _write_run(tmp_path, "b", slow_factor=1.5)
    assert main(["compare", str(a), str(b), "--format", "csv"]) == 1
    captured = capsys.readouterr()
    assert "dot_chain/n=4/ours/time" in captured.err and "torch" not in captured.err
    assert "worse" in captured.out
    # below the threshold the same change is not a failure; the other direction is better
    assert main(["compare", str(a), str(b), "--threshold", "0.6"]) == 0
    table = compare_runs(b, a, metrics=["time"])
    assert table.set_index("variant")["label"].to_dict() == {"ours": "better", "torch": "same"}
    row = compare_runs(a, b, metrics=["time"]).set_index("variant").loc["ours"]
    assert row.ci_low <= 1.5 <= row.ci_high and row.p_value < 0.01


def test_higher_throughput_is_better_and_bad_input_is_refused(tmp_path, capsys):
    a = make_record(benchmark="b", case="c", engine="e", device="cpu", dtype="float32", metric="throughput",
                    value=1.0, unit="model-samples/s")
    frame_a = pd.DataFrame([{**a, "value": v, "params": '{"trial": %d}' % i} for i, v in enumerate(TIMES)])
    frame_b = frame_a.assign(value=frame_a["value"] * 2)
    assert compare_records(frame_a, frame_b)["label"].tolist() == ["better"]
    with pytest.raises(ValueError, match="threshold"):
        compare_records(frame_a, frame_b, threshold=5)
    assert main(["compare", str(tmp_path / "missing"), str(tmp_path / "missing")]) == 2
    assert "no run" in capsys.readouterr().err


def _timed(values_by_trial, engine="torch"):
    return pd.DataFrame([
        make_record(benchmark="b", case="c", engine=engine, device="cpu", dtype="float64", metric="time", value=value,
                    unit="s", repeat=repeat, params={"trial": trial})
        for trial, values in enumerate(values_by_trial) for repeat, value in enumerate(values)])


def test_trial_values_take_one_median_per_trial_and_every_row_without_trials():
    from benchlib.analysis.compare import trial_values

    assert trial_values(_timed([[1.0, 9.0, 1.0], [2.0], [3.0, 3.0]])).tolist() == [1.0, 2.0, 3.0]
    plain = pd.DataFrame([make_record(benchmark="b", case="c", engine="torch", device="cpu", dtype="float64",
                                      metric="time", value=v, unit="s", repeat=i) for i, v in enumerate([1.0, 2.0])])
    assert trial_values(plain).tolist() == [1.0, 2.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["step", "v2"]), st.sampled_from(["torch", "torch-autocast"]),
                          st.sampled_from(["time", "peak_bytes"]), st.one_of(st.none(), st.integers(0, 3)),
                          st.floats(0, 1e6)), min_size=1, max_size=40))
def test_trial_values_of_every_group_in_one_pass_are_each_groups_trial_values_in_order(rows):
    from benchlib.analysis.compare import trial_values, trial_values_by

    frame = pd.DataFrame([make_record(benchmark="b", case=case, engine=engine, device="cpu", dtype="float32",
                                      metric=metric, value=value, unit="s" if metric == "time" else "B", repeat=i,
                                      params={} if trial is None else {"trial": trial})
                          for i, (case, engine, metric, trial, value) in enumerate(rows)])
    keys = ["case", "variant", "metric"]
    expected = {key: trial_values(group) for key, group in frame.groupby(keys, sort=False)}
    found = trial_values_by(frame, keys)
    assert found.keys() == expected.keys()
    for key, values in expected.items():
        assert found[key].tolist() == values.tolist(), key


def test_noise_table_flags_a_planted_outlier_and_a_loaded_start_but_not_steady_trials():
    from benchlib.analysis.compare import noise_table, noise_text

    steady = [[1.0], [1.01], [0.99], [1.0], [1.02]]
    assert noise_table(_timed(steady)).empty
    planted = noise_table(_timed([[1.0], [1.01], [0.99], [1.0], [0.019]]))  # a 50x stall, like the 0.26 GFLOP/s sample
    (row,) = planted.itertuples()
    assert row.variant == "torch" and row.metric == "time" and "outliers 0.019" in row.flags
    loaded = noise_table(_timed(steady), load_average=3.5, cores=2)
    assert "load average 3.50 at start > 2 cores" in loaded["flags"].iloc[0]
    assert noise_text(planted).startswith("noise: 1 timed measurement(s) flagged")


def test_few_trials_are_same_only_when_the_whole_interval_is_within_the_threshold_and_never_worse():
    def trials(metric, unit, values):
        return pd.DataFrame([make_record(benchmark="b", case="c", engine="e", device="cpu", dtype="float64",
                                         metric=metric, value=v, unit=unit, params={"trial": i})
                             for i, v in enumerate(values)])
    peaks = compare_records(trials("peak_bytes", "B", [1000, 1001, 999]), trials("peak_bytes", "B", [1000, 1002, 1000]))
    assert peaks["label"].tolist() == ["same"]
    drifted = compare_records(trials("time", "s", [1.0, 1.02, 0.98]), trials("time", "s", [1.2, 1.22, 1.18]))
    assert drifted["label"].tolist() == ["inconclusive"]  # 3 trials a side: no rank test can call it worse


def _trials(metric, unit, values, *, with_trials=True):
    return pd.DataFrame([make_record(benchmark="b", case="c", engine="e", device="cpu", dtype="float64", metric=metric,
                                     value=v, unit=unit, repeat=i, params={"trial": i} if with_trials else {})
                         for i, v in enumerate(values)])


def test_timings_from_one_process_without_trials_never_gate_however_far_they_moved():
    # the repeats of one sitting: their scatter says nothing of the drift between two sittings
    a, b = _trials("time", "s", TIMES, with_trials=False), _trials("time", "s", TIMES * 1.7, with_trials=False)
    (row,) = compare_records(a, b).itertuples()
    assert row.label == "inconclusive" and np.isnan(row.p_value) and row.ratio == pytest.approx(1.7)
    with_trials = compare_records(_trials("time", "s", TIMES), _trials("time", "s", TIMES * 1.7))
    assert with_trials["label"].tolist() == ["worse"]


def test_a_gc_pause_that_did_not_happen_in_one_trial_is_compared_not_refused():
    # a zero pause is a measurement: the rank test takes it, and no ratio is divided by it
    row = compare_records(_trials("gc_time", "s", [1e-4, 2e-4]), _trials("gc_time", "s", [0.0, 1e-4]))
    assert row["label"].tolist() == ["noisy"] and row["median_b"].tolist() == [5e-5]
    assert compare_times([0.0] * 5, [0.0] * 5).verdict == "same"
    assert compare_times([0.0] * 5, [1e-3] * 5).verdict == "differ"


def test_tight_sizes_gate_on_their_ranges_and_loose_ones_or_context_do_not():
    tight_a, tight_b = [16_000_000, 16_010_000, 16_005_000], [17_600_000, 17_610_000, 17_605_000]
    assert compare_records(_trials("peak_bytes", "B", tight_a), _trials("peak_bytes", "B", tight_b))["label"].tolist() == ["worse"]
    assert compare_records(_trials("peak_bytes", "B", tight_b), _trials("peak_bytes", "B", tight_a))["label"].tolist() == ["better"]
    # an in-kernel peak whose trials spread 4%: three trials 10% apart are not evidence
    loose_a, loose_b = [26.2e6, 25.6e6, 25.1e6], [29.5e6, 28.9e6, 29.9e6]
    assert compare_records(_trials("peak_bytes", "B", loose_a), _trials("peak_bytes", "B", loose_b))["label"].tolist() == ["inconclusive"]
    # deterministic allocation counts repeated in one process decide exactly, trials or not
    counts = compare_records(_trials("warm_alloc_count", "count", [419, 419], with_trials=False),
                             _trials("warm_alloc_count", "count", [500, 500], with_trials=False))
    assert counts["label"].tolist() == ["worse"]
    context = compare_records(_trials("baseline_bytes", "B", tight_a), _trials("baseline_bytes", "B", tight_b))
    assert context["label"].tolist() == ["no direction"]


def test_machine_drift_reads_the_calibration_timings_of_both_runs():
    from benchlib.analysis.compare import machine_drift

    def calibration(seconds, rate):
        rows = _trials("time", "s", seconds)
        rows = pd.concat([rows, _trials("flop_rate", "FLOP/s", rate)])
        return rows.assign(benchmark="calibration")

    table = compare_records(calibration(TIMES, TIMES), calibration(TIMES * 1.3, TIMES / 1.3))
    assert machine_drift(table, ["calibration"]).startswith("machine drift: calibration took 1.30x as long in B as in A (median of 2")
    assert machine_drift(compare_records(_trials("time", "s", TIMES), _trials("time", "s", TIMES)), ["calibration"]) is None


@pytest.mark.slow  # its run's environment asks git for the commit
@pytest.mark.parametrize(("extra", "message"), [
    (["--metric", "nosuch"], "metric nosuch: in neither run; they hold: peak_bytes, time"),
    (["--benchmark", "nosuch"], "benchmark nosuch: in neither run; they hold: dot_chain"),
])
def test_unknown_metric_or_benchmark_is_exit_2_naming_what_the_runs_hold(tmp_path, capsys, extra, message):
    a, b = _write_run(tmp_path, "a"), _write_run(tmp_path, "b")
    assert main(["compare", str(a), str(b), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_run_without_records_is_exit_2(tmp_path, capsys):
    a, empty = _write_run(tmp_path, "a"), Run.create(tmp_path / "empty", "cpu").path
    assert main(["compare", str(a), str(empty)]) == 2
    assert f"{empty} has no records" in capsys.readouterr().err


@pytest.mark.slow  # its run's environment asks git for the commit
def test_the_table_answers_first_counts_and_worst_regressions(tmp_path, capsys):
    a, b = _write_run(tmp_path, "a"), _write_run(tmp_path, "b", slow_factor=1.5)
    assert main(["compare", str(a), str(b)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 metric(s): 1 worse, 0 better, 3 same, 0 noisy, 0 inconclusive, 0 no direction")
    assert "dot_chain/n=4/ours/time" in lines[2] and "1.5" in lines[2]


def test_the_default_table_fits_120_columns_and_reads_what_moved_first():
    from benchlib.analysis.compare import compact_table

    comparison = pd.DataFrame([
        {"benchmark": "a_benchmark_with_a_rather_long_name_indeed", "case": "case_" + "x" * 60, "variant": "torch",
         "metric": "peak_bytes", "unit": "B", "median_a": 1.5e6, "median_b": 1.5e6, "ratio": 1.0, "ci_low": 0.99,
         "ci_high": 1.01, "label": "same"},
        {"benchmark": "b", "case": "step", "variant": "torch.func", "metric": "time", "unit": "s", "median_a": 2e-3,
         "median_b": 3e-3, "ratio": 1.5, "ci_low": 1.4, "ci_high": 1.6, "label": "worse"},
        {"benchmark": "b", "case": "step", "variant": "torch", "metric": "time", "unit": "s", "median_a": 2e-3,
         "median_b": 2.1e-3, "ratio": 1.05, "ci_low": 0.8, "ci_high": 1.3, "label": "inconclusive",
         "stopped": "A: 3 trials, precision; B: 5 trials, max_trials"}]).assign(
        stopped=lambda frame: frame["stopped"].fillna(""))
    lines = compact_table(comparison)
    assert max(map(len, lines)) <= 120
    assert lines[0].startswith("b/step/torch.func/time") and "2 ms -> 3 ms" in lines[0] and lines[0].endswith("worse")
    assert lines[1].startswith("b/step/torch/time") and lines[1].endswith("inconclusive")
    assert lines[2] == "    trials stopped: A: 3 trials, precision; B: 5 trials, max_trials"  # why it could not decide
    # a name too long for its column: whole on its own line, its figures under it (before: cut to 20 characters)
    assert lines[3] + lines[4].strip() == "a_benchmark_with_a_rather_long_name_indeed/case_" + "x" * 60 + "/torch/peak_bytes"
    assert lines[5].startswith("    ") and "1.5 MB -> 1.5 MB" in lines[5] and len(lines) == 6


def test_metrics_of_one_name_are_told_apart_by_the_settings_that_differ():
    from benchlib.analysis.compare import compact_table

    row = {"benchmark": "calibration", "case": "matmul", "variant": "numpy", "metric": "flop_rate", "unit": "FLOP/s",
           "device": "cpu", "median_a": 1e10, "median_b": 1e10, "ratio": 1.0, "ci_low": 0.99, "ci_high": 1.01,
           "label": "same", "stopped": ""}
    comparison = pd.DataFrame([{**row, "dtype": "float32", "config": '{"n": 64, "torch_threads": 2}'},
                               {**row, "dtype": "float32", "config": '{"n": 256, "torch_threads": 2}'},
                               {**row, "dtype": "float64", "config": '{"n": 256, "torch_threads": 2}'}])
    names = [line.split("  ")[0] for line in compact_table(comparison) if not line.startswith(" ")]
    assert names == ["calibration/matmul/numpy/flop_rate [dtype=float32, n=64]",
                     "calibration/matmul/numpy/flop_rate [dtype=float32, n=256]",
                     "calibration/matmul/numpy/flop_rate [dtype=float64, n=256]"]


def test_a_largest_fitting_value_that_falls_is_worse_where_a_byte_count_that_falls_is_better():
    import benchlib.fit.result  # noqa: F401  (registers the fit's metrics, max_fitting higher-is-better among them)

    def run(value: float) -> pd.DataFrame:
        return pd.DataFrame([make_record(benchmark="b", case="fit n", engine="torch", device="cpu", dtype="float32",
                                         metric=metric, value=value,
                                         params={"trial": trial, "scale": "n"})
                             for trial in (0, 1) for metric in ("max_fitting", "fit_total_bytes")])

    labels = compare_records(run(1000.0), run(500.0)).set_index("metric")["label"]
    assert labels["max_fitting"] == "worse" and labels["fit_total_bytes"] == "better"


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_report_of_a_run_deleted_meanwhile_is_refused_and_never_makes_the_folder_again(tmp_path, monkeypatch):
    import shutil

    from benchlib.report import page

    run = Run.create(tmp_path, "cpu", notebooks={})
    run.finish(interrupted=False)
    monkeypatch.setattr(page, "build_report", lambda path: (shutil.rmtree(path), "<html></html>")[1])
    with pytest.raises(OSError, match="report.html"):
        page.write_report(run.path)
    assert not run.path.exists()


def test_a_module_renamed_between_runs_is_named_as_not_compared_never_silently_dropped():
    from benchlib.analysis.compare import one_sided_text

    def run(module):
        return pd.DataFrame([make_record(benchmark="b", case="step", engine="torch", device="cpu", dtype="float32",
                                         metric=metric, value=1000.0, unit="B",
                                         params={"trial": trial, **({"module": module, "role": "parameters"}
                                                                    if metric == "module_bytes" else {})})
                             for trial in range(3) for metric in ("peak_bytes", "module_bytes")])

    table = compare_records(run("layers.0"), run("blocks.0"))
    assert table["metric"].tolist() == ["peak_bytes"]  # the one measurement both runs hold
    assert one_sided_text(table) == ("not compared (in one run only; a renamed module, engine or metric is another "
                                     "measurement): only in A: b/step/torch/module_bytes layers.0 parameters; "
                                     "only in B: b/step/torch/module_bytes blocks.0 parameters")
    assert one_sided_text(compare_records(run("layers.0"), run("layers.0"))) == ""


@pytest.mark.slow  # its runs' environment asks git for the commit
def test_a_candidate_that_measured_nothing_is_no_comparison_never_no_regression(tmp_path, capsys):
    """Markers (an engine not applicable, a case that failed) have no direction: a run that holds only them beside
    a baseline's measurements must not pass a CI gate as 'no regression'."""
    from benchlib.records.schema import status_record

    def marker(run):
        return status_record(status="not_applicable", message="no GPU", benchmark="dot_chain", case="n=4",
                             engine="torch-offload", device="cpu", dtype="float64")

    baseline = Run.create(tmp_path / "a", "cpu")
    baseline.save_records([marker(baseline), *(make_record(benchmark="dot_chain", case="n=4", engine="torch",
                                                           device="cpu", dtype="float64", metric="peak_bytes",
                                                           value=1000.0, unit="B", params={"trial": trial})
                                               for trial in range(3))], "dot_chain")
    candidate = Run.create(tmp_path / "b", "cpu")
    candidate.save_records([marker(candidate)], "dot_chain")
    assert main(["compare", str(baseline.path), str(candidate.path)]) == 2
    said = capsys.readouterr()
    assert "nothing to compare: the only metrics in both runs have no direction (not_applicable" in said.err
    assert "no regression" not in said.out
