"""Parameter grids: parsing, planning refusals, points run locally and on a local Dask cluster."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

from benchlib.records import load_records, load_run_info
from benchlib.runner import RunnerError
from benchlib.runner.cli import main
from benchlib.runner.arguments import parse_grid
from benchlib.runner.sweep import execute_remote, unpack_point

NOTEBOOKS = Path(__file__).parent / "notebooks"


def grid_run(tmp_path, *argv):
    return main(["run", *argv, "--device", "cpu", "--no-progress", "--notebooks-dir", str(NOTEBOOKS),
                 "--out", str(tmp_path)])


def test_grid_values_parse_as_literals_or_comma_separated_text():
    assert parse_grid(["D=100,200", "dtype=float32,float64", "engines=['a'],['b', 'c']", "failing=,torch"]) == {
        "D": [100, 200], "dtype": ["float32", "float64"], "engines": [["a"], ["b", "c"]], "failing": ["", "torch"]}
    for bad, message in ((["D"], "NAME=V1,V2"), (["D=1", "D=2"], "given twice"), (["D=1,1"], "repeats a value")):
        with pytest.raises(RunnerError, match=message):
            parse_grid(bad)


@pytest.mark.parametrize(("argv", "message"), [
    (["probe", "--grid", "size=a,b"], "probe: size must be an integer, got 'a'"),
    (["probe", "--grid", "nosuch=1,2"], "no selected notebook has a parameter 'nosuch'"),
    (["probe", "--grid", "size=1,2", "-p", "size=3"], "both a -p value and a --grid axis"),
    (["dot_chain", "--grid", "depth=0,10"], "depth must be an integer >= 1, got 0"),
    (["probe", "--scheduler", "tcp://127.0.0.1:1"], "--scheduler goes with --executor dask"),
])
def test_bad_grids_are_refused_with_exit_2_before_anything_runs(argv, message, tmp_path, capsys):
    argv = [*argv, "--device", "cpu", "--out", str(tmp_path / "out")]
    if argv[0] != "dot_chain":
        argv += ["--notebooks-dir", str(NOTEBOOKS)]
    assert main(["run", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def assert_four_points_landed(run_dir: Path) -> None:
    info = load_run_info(run_dir)
    assert info["grid"] == {"size": [10, 20], "label": ["a", "b"]}
    points = {key: entry for key, entry in info["notebooks"].items()}
    assert sorted(points) == ["probe@size=10,label=a", "probe@size=10,label=b", "probe@size=20,label=a",
                              "probe@size=20,label=b"]
    assert all(entry["status"] == "ok" for entry in points.values())
    records = load_records(run_dir)
    seen = sorted((json.loads(p)["grid"]["size"], json.loads(p)["grid"]["label"], json.loads(p)["label"], v)
                  for p, v in zip(records["params"], records["value"]))
    assert seen == [(10, "a", "a", 10.0), (10, "b", "b", 10.0), (20, "a", "a", 20.0), (20, "b", "b", 20.0)]
    for key in points:
        assert (run_dir / "notebooks" / f"{key}.ipynb").is_file()
        assert (run_dir / "points" / key / "records" / "probe.parquet").is_file()


@pytest.mark.slow
def test_a_two_by_two_grid_runs_locally_and_lands_every_point(tmp_path):
    assert grid_run(tmp_path, "probe", "--grid", "size=10,20", "--grid", "label=a,b") == 0
    (run_dir,) = tmp_path.iterdir()
    assert_four_points_landed(run_dir)


@pytest.mark.slow
def test_a_two_by_two_grid_runs_on_a_local_dask_cluster(tmp_path):
    pytest.importorskip("distributed", reason="the dask extra is not installed")
    assert grid_run(tmp_path, "probe", "--grid", "size=10,20", "--grid", "label=a,b", "--executor", "dask") == 0
    (run_dir,) = tmp_path.iterdir()
    assert_four_points_landed(run_dir)
    assert load_run_info(run_dir)["executor"] == "dask (local cluster)"


@pytest.mark.slow
def test_a_failing_point_is_recorded_and_the_others_land(tmp_path):
    assert grid_run(tmp_path, "cases", "-p", "engines=['manual']", "--grid", "failing=,manual") == 1
    (run_dir,) = tmp_path.iterdir()
    notebooks = load_run_info(run_dir)["notebooks"]
    assert notebooks["cases@failing="]["status"] == "ok"
    assert notebooks["cases@failing=manual"]["status"] == "failed"
    assert "AllCasesFailed" in notebooks["cases@failing=manual"]["error"]
    assert set(load_records(run_dir)["variant"]) == {"manual"}


@pytest.mark.slow
def test_a_point_comes_back_as_bytes_of_files_never_a_pickled_object(tmp_path):
    packed = execute_remote((NOTEBOOKS / "probe.ipynb").read_text(), "probe", {"device": "cpu", "size": 3},
                            str(NOTEBOOKS), {})
    assert type(packed) is bytes
    with zipfile.ZipFile(io.BytesIO(packed)) as archive:
        names = archive.namelist()
    assert "point.json" in names and "executed.ipynb" in names and "results/records/probe.parquet" in names
    assert all(name.endswith((".json", ".parquet", ".ipynb", ".html", ".js")) for name in names)
    summary = unpack_point(packed, tmp_path / "point", tmp_path / "executed.ipynb")
    assert summary["status"] == "ok" and load_records(tmp_path / "point")["value"].tolist() == [3.0]


@pytest.mark.slow
def test_without_a_grid_a_dask_run_keeps_the_runners_run_json_and_merges_the_records(tmp_path):
    pytest.importorskip("distributed", reason="the dask extra is not installed")
    assert grid_run(tmp_path, "probe", "--quick", "--executor", "dask") == 0
    (run_dir,) = tmp_path.iterdir()
    info = load_run_info(run_dir)
    assert info["runner"]["pid"] and info["notebooks"]["probe"]["status"] == "ok"
    assert load_records(run_dir)["value"].tolist() == [10.0]
    assert (run_dir / "points" / "probe" / "run.json").is_file()


def test_grid_values_that_sanitize_alike_keep_distinct_readable_keys():
    from benchlib.runner.notebooks import select_notebooks
    from benchlib.runner.preflight import expand

    (spec,) = select_notebooks(["probe"], NOTEBOOKS)
    keys = [e.key for e in expand([(spec, {})], {"label": ["a b", "a-b", "a/b", "c"]}, {})]
    assert len(set(keys)) == 4
    assert all(key.startswith("probe@label=a-b") for key in keys[:3]) and keys[3] == "probe@label=c"
    assert keys == [e.key for e in expand([(spec, {})], {"label": ["a b", "a-b", "a/b", "c"]}, {})]  # stable


@pytest.mark.slow
def test_a_grid_whose_values_sanitize_alike_keeps_every_points_records(tmp_path):
    assert grid_run(tmp_path, "probe", "--grid", "label=a b,a-b,a/b") == 0
    (run_dir,) = tmp_path.iterdir()
    assert len(load_run_info(run_dir)["notebooks"]) == 3
    labels = sorted(json.loads(p)["grid"]["label"] for p in load_records(run_dir)["params"])
    assert labels == ["a b", "a-b", "a/b"]


class _Future:
    """Stands in for a Dask future: its result, or the error a dead worker gives."""

    def __init__(self, key):
        self.key, self.cancelled = key, False

    def result(self):
        raise RuntimeError("the worker died")

    def cancel(self):
        self.cancelled = True


class _Client:
    """Stands in for a Dask client: takes submissions, runs nothing."""

    def __init__(self):
        self.futures = []
        self.scheduler = type("Scheduler", (), {"address": "inproc://test"})()

    def submit(self, *args, key, **kwargs):
        self.futures.append(_Future(key))
        return self.futures[-1]

    def close(self):
        pass


@pytest.mark.slow  # its run's environment asks git for the commit
def test_ctrl_c_during_a_dask_grid_leaves_no_point_submitted(tmp_path, monkeypatch):
    """Ctrl-C after one point came back: that point keeps its state, every other ends `interrupted` in run.json."""
    distributed = pytest.importorskip("distributed", reason="the dask extra is not installed")
    from benchlib.runner import execute

    client = _Client()

    def one_then_ctrl_c(futures):
        yield next(iter(futures))
        raise KeyboardInterrupt

    monkeypatch.setattr(execute, "dask_client", lambda scheduler: (client, None))
    monkeypatch.setattr(distributed, "as_completed", one_then_ctrl_c)
    assert grid_run(tmp_path, "probe", "--grid", "size=10,20,30", "--executor", "dask") == 130
    (run_dir,) = tmp_path.iterdir()
    info = load_run_info(run_dir)
    states = {key: entry["status"] for key, entry in info["notebooks"].items()}
    assert states == {"probe@size=10": "failed", "probe@size=20": "interrupted", "probe@size=30": "interrupted"}
    assert info["interrupted"] is True and info["ended_at"]
    assert all(future.cancelled for future in client.futures)
