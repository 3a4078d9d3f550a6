"""A notebook run without the runner (JupyterLab, papermill alone) ends as a finished run."""
import json

import pytest

from benchlib.records import Run
from benchlib.records.schema import make_record, status_record
from benchlib.records.places import RUN_INFO
from benchlib.records.store import list_runs
from benchlib.registry import get
from benchlib.runner.interactive import finish_notebook


@pytest.fixture
def results_root(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHLIB_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def _records(*, failed: bool = False) -> list[dict]:
    labels = {"benchmark": "dot_chain", "case": "D=8,depth=2", "device": "cpu", "dtype": "float64"}
    rows = [make_record(metric="peak_bytes", value=1000.0 + trial, unit="B", engine=engine, params={"trial": trial}, **labels)
            for engine in ("manual", "benchlib-deferred") for trial in range(3)]
    if failed:
        rows.append(status_record(status="failed", message="RuntimeError: boom", engine="torch", **labels))
    return rows


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_notebook_run_opened_in_the_kernel_is_running_until_its_last_cell_then_finished_with_a_report(results_root):
    config = get("dot_chain").config({"D": 8, "depth": 2})
    run = Run.open("", device="cpu", config=config)
    assert list_runs(results_root).set_index("run_id").loc[run.run_id, "state"] == "running"  # this process is its kernel
    entry = json.loads((run.path / RUN_INFO).read_text())["notebooks"]["dot_chain"]
    assert entry["status"] == "running" and entry["parameters"]["D"] == 8

    run.save_records(_records(), "dot_chain")
    report = finish_notebook(run)

    info = json.loads((run.path / RUN_INFO).read_text())
    assert info["ended_at"] and info["notebooks"]["dot_chain"]["status"] == "ok"
    assert info["notebooks"]["dot_chain"]["duration_s"] >= 0
    assert report == run.path / "report.html" and report.is_file()
    assert (run.path / "verdicts.parquet").is_file()
    assert list_runs(results_root).set_index("run_id").loc[run.run_id, "state"] == "finished"
    assert finish_notebook(run) is None  # once


@pytest.mark.slow  # its run's environment asks git for the commit
def test_failed_cases_make_an_interactive_notebook_partial_as_the_runner_would(results_root):
    run = Run.open("", device="cpu", config=get("dot_chain").config({"D": 8, "depth": 2}))
    run.save_records(_records(failed=True), "dot_chain")
    finish_notebook(run)
    entry = json.loads((run.path / RUN_INFO).read_text())["notebooks"]["dot_chain"]
    assert entry["status"] == "partial" and entry["failed_cases"] == ["torch (D=8,depth=2): RuntimeError: boom"]
    assert list_runs(results_root).set_index("run_id").loc[run.run_id, "failed"] == 1


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_run_the_runner_made_is_left_to_the_runner(results_root):
    made = Run.create(results_root, device="cpu")  # what `benchlib run` does before the kernels start
    joined = Run.open(str(made.path), device="cpu", config=get("dot_chain").config())
    assert finish_notebook(joined) is None
    info = json.loads((made.path / RUN_INFO).read_text())
    assert info["ended_at"] is None and info["notebooks"] == {} and not (made.path / "report.html").exists()


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_run_opened_at_quick_values_says_so_and_one_opened_under_the_runner_is_the_runners(results_root, monkeypatch):
    from benchlib.benchmark import Config
    from benchlib.records.store import UNDER_RUNNER_ENV

    quick = get("dot_chain").config(get("dot_chain").quick)
    run = Run.open("", device="cpu", config=Config(quick.benchmark, quick, at_quick_values=True))
    assert json.loads((run.path / RUN_INFO).read_text())["quick"] is True  # the report judges verdicts as a first look
    monkeypatch.setenv(UNDER_RUNNER_ENV, "1")  # a grid point's kernel: its folder has no run.json yet
    point = Run.open(str(results_root / "run" / "points" / "depth=4"), device="cpu", config=quick)
    assert point.info["created_by"] == "benchlib run" and finish_notebook(point) is None
    assert not (point.path / "report.html").exists()
