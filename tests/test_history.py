"""`benchlib history`: series over runs from synthetic records (seeded), the command on run
directories written by the test, its refusals, and one history of real runs of a model file."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from benchlib.records import Run, make_record
from benchlib.analysis.history import build_series, find_steps, point_commit, series_name
from benchlib.runner.cli import main


def _records(medians, *, metric="peak_bytes", unit="B", spread=0.0, trials=3, seed=0, commits=None, variant="torch"):
    """One run per median, `trials` trials each (relative normal spread), as `read_history` gives them."""
    rng = np.random.default_rng(seed)
    rows = []
    for index, median in enumerate(medians):
        for trial in range(trials):
            value = median * (1 + spread * rng.standard_normal())
            rows.append({**make_record(benchmark="mlp", case="step", engine=variant, device="cpu", dtype="float32",
                                       metric=metric, value=value, unit=unit, params={"trial": trial, "width": 8}),
                         "run_id": f"run{index}", "started_at": f"2026-11-{index + 1:02d}T10:00:00+00:00",
                         "commit": (commits or [f"c{i:06d}" for i in range(len(medians))])[index]})
    return pd.DataFrame(rows)


def test_a_step_names_the_first_run_after_it_its_commit_and_ratio():
    records = pd.concat([_records([1000.0] * 3 + [1500.0] * 3),
                         _records([0.02] * 6, metric="time", unit="s", spread=0.05, variant="torch.func")])
    steps = find_steps(build_series(records), threshold=0.05)
    assert len(steps) == 1  # the noisy, flat time has none
    step = steps.iloc[0]
    assert (step.metric, step.variant, step.from_run, step.to_run, step.to_commit) == \
        ("peak_bytes", "torch", "run2", "run3", "c000003")
    assert (step.ratio, step.ci_low, step.ci_high) == (1.5, 1.5, 1.5)
    assert step.label == "worse" and step.latest and (step.runs_before, step.runs_after) == (3, 3)


@pytest.mark.parametrize("runs", [3, 8, 20])
@pytest.mark.parametrize("seed", range(5))
def test_a_flat_noisy_series_has_no_step(runs, seed):
    records = _records([0.02] * runs, metric="time", unit="s", spread=0.15, trials=2, seed=seed)
    assert find_steps(build_series(records), threshold=0.05).empty


def test_counts_without_spread_step_only_past_the_threshold():
    small = _records([354.0] * 4 + [360.0] * 4, metric="alloc_count", unit="count")  # 1.7%: below 5%
    large = _records([354.0] * 4 + [400.0] * 4, metric="alloc_count", unit="count")
    zeros = _records([0.0] * 3 + [0.001] * 3, metric="gc_time", unit="s")  # no pause before: no ratio to take
    assert find_steps(build_series(small), threshold=0.05).empty
    assert find_steps(build_series(zeros), threshold=0.05).empty
    step = find_steps(build_series(large), threshold=0.05).iloc[0]
    assert step.to_run == "run4" and step.ratio == pytest.approx(400 / 354)


def test_single_measurements_a_run_never_make_a_step_on_one_value_a_side():
    # a fit's totals: one measurement per run and value, no trials; process-to-process noise of 31% between runs
    records = _records([100e6, 131e6, 131e6], trials=1)
    assert find_steps(build_series(records), threshold=0.05).empty
    stepped = find_steps(build_series(_records([100e6, 100e6, 131e6, 131e6], trials=1)), threshold=0.05)
    assert len(stepped) == 1 and stepped.iloc[0]["runs_before"] == 2  # two a side: judged


def test_a_regression_then_its_fix_is_two_steps_the_latest_better():
    steps = find_steps(build_series(_records([1000.0] * 3 + [2000.0] * 3 + [1000.0] * 3, spread=0.01)),
                       threshold=0.05)
    assert steps["label"].tolist() == ["worse", "better"] and steps["latest"].tolist() == [False, True]
    assert steps["to_run"].tolist() == ["run3", "run6"]


def test_by_commit_keeps_a_commit_measured_again_with_its_first_runs():
    # run3 measures commit c0 again, after c1's runs: by commit it sits with c0, so c1 is the step
    records = _records([1000.0, 1000.0, 2000.0, 1000.0, 2000.0], commits=["c0", "c0", "c1", "c0", "c1"])
    by_commit = build_series(records)
    assert by_commit["run_id"].tolist() == ["run0", "run1", "run3", "run2", "run4"]
    assert find_steps(by_commit, threshold=0.05)["to_run"].tolist() == ["run2"]
    assert build_series(records, by="time")["run_id"].tolist() == ["run0", "run1", "run2", "run3", "run4"]


def test_a_points_commit_is_its_model_files_else_benchlibs():
    info = {"environment": {"git": {"commit": "b" * 40, "dirty": False}},
            "model_files": {"mlp/v2": {"git": {"commit": "a" * 40, "dirty": True}}, "other": {"git": {"commit": None}}}}
    assert point_commit(info, "mlp", "v2") == "aaaaaaa-dirty"
    assert point_commit(info, "dot_chain", "n=4") == "bbbbbbb"
    assert point_commit(info, "other", "step") is None  # a model file outside git: benchlib's commit is not its


def _write_runs(root, peaks, *, commits=True, headline=("peak_bytes",)):
    """Run directories under `root`, one per peak (bytes, three exact trials), a day apart."""
    for index, peak in enumerate(peaks):
        run_id = f"2026110{index + 1}-100000-test"
        git = {"commit": f"{index:x}" * 40, "dirty": False} if commits else {"commit": None, "dirty": None}
        run = Run(root / run_id, {"run_id": run_id, "started_at": f"2026-11-0{index + 1}T10:00:00+00:00", "notebooks": {},
                                  "environment": {"git": git}, "benchmarks": {"mlp": {"headline": list(headline)}}})
        run.write_info()
        run.save_records([make_record(benchmark="mlp", case="step", engine="torch", device="cpu", dtype="float32",
                                      metric=metric, value=value, unit=unit, params={"trial": trial})
                          for trial in range(3)
                          for metric, value, unit in (("peak_bytes", peak, "B"), ("time", 0.01, "s"))], "mlp")


def test_the_command_exits_one_on_a_latest_regression_and_writes_the_page(tmp_path, capsys):
    _write_runs(tmp_path, [1000.0] * 3 + [2000.0] * 3)
    assert main(["history", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("1 step in 1 series over 6 runs; latest step in mlp/step/torch/peak_bytes is a regression: 2x")
    assert "20261103-100000-test → 20261104-100000-test" in out and "2222222 → 3333333" in out
    assert "1 kB → 2 kB" in out
    page = (tmp_path / "history.html").read_text()
    assert "data-figures='1'" in page and "mlp/step/torch/peak_bytes" in page
    # time is not a headline of these runs, but --metric asks for it: flat, so no step
    assert main(["history", "--out", str(tmp_path), "--metric", "time", "--html", str(tmp_path / "t.html")]) == 0
    assert capsys.readouterr().out.startswith("no step in 1 series over 6 runs")


def test_the_command_exits_zero_when_the_latest_step_is_an_improvement(tmp_path, capsys):
    _write_runs(tmp_path, [1000.0] * 3 + [2000.0] * 3 + [1000.0] * 3)
    assert main(["history", "--out", str(tmp_path)]) == 0
    assert "2 steps in 1 series over 9 runs; no latest step is a regression" in capsys.readouterr().out


def test_bad_input_is_refused_with_one_line(tmp_path, capsys):
    def refused(*args):
        assert main(["history", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("benchlib: error: ") and "Traceback" not in err
        return err

    assert "no runs with records" in refused("--out", str(tmp_path))
    assert "no results directory" in refused("--out", str(tmp_path / "missing"))
    assert "no run 'nowhere'" in refused("nowhere", "--out", str(tmp_path))
    _write_runs(tmp_path / "two", [1000.0, 1000.0])
    assert "fewer than 3 runs in every series (the most: 2" in refused("--out", str(tmp_path / "two"))
    _write_runs(tmp_path / "four", [1000.0] * 4)
    assert "unknown metric peak; the runs hold (with a better direction): peak_bytes, time" in \
        refused("--out", str(tmp_path / "four"), "--metric", "peak")
    assert "unknown benchmark dot; the runs hold: mlp" in refused("--out", str(tmp_path / "four"), "--benchmark", "dot")
    assert "--threshold" in refused("--out", str(tmp_path / "four"), "--threshold", "0")
    _write_runs(tmp_path / "nogit", [1000.0] * 4, commits=False)  # made outside git: placed by start time, and said
    assert main(["history", "--out", str(tmp_path / "nogit")]) == 0
    assert "4 run(s) without a recorded commit (made outside git) are placed by their start time: " \
           "20261101-100000-test, 20261102-100000-test" in capsys.readouterr().out
    assert main(["history", "--out", str(tmp_path / "nogit"), "--by", "time"]) == 0


def test_an_unreadable_run_is_named_and_skipped(tmp_path, capsys):
    _write_runs(tmp_path, [1000.0] * 4)
    (tmp_path / "20261101-100000-test" / "run.json").write_text("{not json")
    assert main(["history", "--out", str(tmp_path)]) == 1  # answered without a step, but a run could not be read
    captured = capsys.readouterr()
    assert "skipped: " in captured.err and "20261101-100000-test" in captured.err and "run.json" in captured.err
    assert "over 3 runs" in captured.out


MODEL = textwrap.dedent('''
    import torch

    NAME = "history_mlp"
    PARAMETERS = {"width": 1024, "batch_size": 32}
    QUICK = {"width": 1024, "batch_size": 32}
    WIDER = 1


    def model(width, batch_size):
        hidden = width * WIDER
        return torch.nn.Sequential(torch.nn.Linear(512, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


    def batch(width, batch_size):
        return torch.randn(batch_size, 512), torch.randint(0, 10, (batch_size,))


    def loss(model, images, labels):
        return torch.nn.functional.cross_entropy(model(images), labels)
''')


@pytest.mark.slow  # a model of megabytes, whose peaks no busy neighbour moves by the threshold (at 128 wide they did)
@pytest.mark.timeout(1200)  # minutes of work: six runs and the history
def test_real_runs_of_a_model_file_whose_width_doubles_step_and_exit_one(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "results"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    for wider in (1, 1, 1, 4, 4, 4):
        (repo / "model.py").write_text(MODEL.replace("WIDER = 1", f"WIDER = {wider}"))
        subprocess.run([*git, "add", "model.py"], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", f"width x{wider}"], check=True)
        done = subprocess.run([sys.executable, "-m", "benchlib.runner.cli", "run", str(repo / "model.py"), "--quick",
                               "-p", "engines=torch", "-p", "trials=2", "--out", str(out), "--no-progress"],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    commits = subprocess.run([*git, "log", "--format=%h", "-n", "6", "--abbrev=7"], check=True, capture_output=True,
                             text=True).stdout.split()[::-1]
    done = subprocess.run([sys.executable, "-m", "benchlib.runner.cli", "history", "--out", str(out)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is a regression" in done.stdout.splitlines()[0]  # of the peak, or of a time the machine moved
    line = next(line for line in done.stdout.splitlines() if "history_mlp/step/torch/peak_bytes" in line
                and "→" in line)
    assert f"{commits[2]} → {commits[3]}" in line and "worse (latest)" in line
    assert (out / "history.html").is_file()


def test_a_copied_run_directory_is_one_run_counted_once_and_named(tmp_path, capsys):
    import shutil

    _write_runs(tmp_path, [1000.0] * 4)
    assert main(["history", "--out", str(tmp_path)]) == 0
    assert "no step in 1 series over 4 runs" in capsys.readouterr().out
    shutil.copytree(tmp_path / "20261104-100000-test", tmp_path / "zz-copy")
    assert main(["history", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "no step in 1 series over 4 runs" in captured.out
    assert "zz-copy: a copy of run 20261104-100000-test" in captured.err
    assert main(["runs", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert str(tmp_path / "zz-copy") in captured.out and "share a run id (20261104-100000-test)" in captured.err


def test_a_second_machine_at_the_same_commit_is_its_own_series_not_a_step():
    fast = _records([1000.0] * 4, commits=["c1"] * 4).assign(host="fast-box")
    slow = _records([2000.0] * 4, commits=["c1"] * 4).assign(host="slow-box", run_id=lambda f: f["run_id"] + "-slow")
    series = build_series(pd.concat([fast, slow]))
    assert set(series["host"]) == {"fast-box", "slow-box"}
    assert find_steps(series, threshold=0.05).empty  # one commit, two machines: no regression
    names = {series_name(row) for row in series.itertuples()}
    assert names == {"mlp/step/torch/peak_bytes on fast-box", "mlp/step/torch/peak_bytes on slow-box"}
    assert set(build_series(fast)["host"]) == {""}  # one machine: no host in the names


def test_a_runs_machine_is_its_hardware_not_its_host_name():
    from benchlib.analysis.history import machine

    info = {"environment": {"host": "runner-8f2c", "cpu": {"model": "AMD EPYC 7B13"},
                            "gpu": {"devices": [{"name": "NVIDIA H100"}]}}}
    assert machine(info) == "AMD EPYC 7B13 + NVIDIA H100"
    assert machine({**info, "environment": {**info["environment"], "host": "runner-91aa"}}) == machine(info)
    assert machine({"environment": {"cpu": {"model": "x"}, "gpu": {"available": False}}}) == "x"
    assert machine({}) == machine({"environment": "not a dict"}) == ""


def _committed_run(tmp_path, index: int) -> Run:
    """The `index`-th of a history of runs, one a day at commits 000..., 111..., with run.json written."""
    run_id = f"2026110{index + 1}-100000-test"
    run = Run(tmp_path / run_id, {"run_id": run_id, "started_at": f"2026-11-0{index + 1}T10:00:00+00:00",
                                  "notebooks": {}, "environment": {"git": {"commit": f"{index:x}" * 40, "dirty": False}},
                                  "benchmarks": {"mlp": {"headline": ["peak_bytes"]}}})
    run.write_info()
    return run


def test_a_module_renamed_before_the_latest_run_is_named_not_dropped_in_silence(tmp_path, capsys):
    for index in range(6):
        run = _committed_run(tmp_path, index)
        module = "layers.0" if index < 4 else "blocks.0"  # renamed in the fifth run
        run.save_records([make_record(benchmark="mlp", case="step", engine="torch", device="cpu", dtype="float32",
                                      metric=metric, value=1000.0, unit="B",
                                      params={"trial": trial, **({"module": module, "role": "parameters"}
                                                                 if metric == "module_bytes" else {})})
                          for trial in range(3) for metric in ("peak_bytes", "module_bytes")], "mlp")
    assert main(["history", "--out", str(tmp_path), "--metric", "module_bytes"]) == 0
    captured = capsys.readouterr()
    assert ("1 series the latest run does not hold (a module, engine or metric renamed or gone; not judged there): "
            "mlp/step/torch/module_bytes layers.0 parameters") in captured.err


def test_series_of_one_name_that_ended_are_told_apart_by_what_differs_in_their_settings(tmp_path, capsys):
    """fit's runs record one series per value measured: where several ended, each is named with its own value, as
    compare names them, never the same name five times."""
    for index in range(4):
        run = _committed_run(tmp_path, index)
        values = (8, 16) if index < 3 else (32,)  # the latest run measured another value only
        run.save_records([make_record(benchmark="mlp", case="fit batch", engine="torch", device="cpu", dtype="float32",
                                      metric="peak_bytes", value=1000.0 * value, unit="B",
                                      params={"trial": trial, "value": value})
                          for trial in range(3) for value in values], "mlp")
    main(["history", "--out", str(tmp_path)])
    said = capsys.readouterr().err
    assert ("2 series the latest run does not hold (a module, engine or metric renamed or gone; not judged there): "
            "mlp/fit batch/torch/peak_bytes [value=16], mlp/fit batch/torch/peak_bytes [value=8]") in said
