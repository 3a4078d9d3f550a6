"""benchlib.runner: parameter checks, refusals before anything runs, and real papermill runs of tests/notebooks/."""

import io
import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

from benchlib.records import load_records, load_run_info
from benchlib.runner import RunnerError, run, select_notebooks, values_for
from benchlib.runner.cli import main

NOTEBOOKS = Path(__file__).parent / "notebooks"


def planned(notebooks=("probe",), quick=False, **params):
    return {spec.name: values for spec, values in values_for(select_notebooks(notebooks, NOTEBOOKS), params=params, quick=quick)}


def test_plan_applies_quick_then_params_with_types_of_the_defaults():
    assert planned(quick=True) == {"probe": {"size": 10}}
    values = planned(quick=True, size="20", scale="2", label="123", engines="['a', 'b']")["probe"]
    assert values == {"size": 20, "scale": 2.0, "label": "123", "engines": ("a", "b")}
    assert isinstance(values["scale"], float)
    # A name goes only to the notebooks that declare it.
    assert planned(("failing", "probe"), size=5) == {"failing": {}, "probe": {"size": 5}}


@pytest.mark.parametrize(
    ("notebooks", "params", "message"),
    [
        (("nosuch",), {}, r"unknown benchmark\(s\): nosuch; known: .*cases, failing, probe"),
        (("probe",), {"sizes": "3"}, r"unknown parameter 'sizes'.*\n.*probe:\n(.|\n)*size: int = 1000"),
        (("probe",), {"size": "3.5"}, r"probe: size must be an integer, got 3.5"),
        (("probe",), {"engines": "3"}, r"probe: engines must be a non-empty list, each a str, got \[3\] \(3 is not valid\)"),
        (("probe",), {"device": "cpu"}, r"use --device"),
    ],
)
def test_plan_refuses_bad_names_and_types(notebooks, params, message):
    with pytest.raises(RunnerError, match=message):
        values_for(select_notebooks(notebooks, NOTEBOOKS), params=params, quick=False)


def test_quick_is_refused_for_a_notebook_without_quick_sizes(tmp_path):
    notebook = nbformat.read(NOTEBOOKS / "failing.ipynb", as_version=4)
    notebook.cells = [cell for cell in notebook.cells if "quick" not in cell.metadata.get("tags", [])]
    nbformat.write(notebook, tmp_path / "plain.ipynb")
    with pytest.raises(RunnerError, match="plain.ipynb has no cell tagged 'quick'"):
        values_for(select_notebooks(["plain"], tmp_path), params={}, quick=True)


def refused_cases():
    cases = [
        (["run", "nosuch"], "unknown benchmark(s): nosuch"),
        (["run", "probe", "-p", "repeats=3"], "unknown parameter 'repeats'"),
        (["run", "probe", "-p", "size=big"], "probe: size must be an integer, got 'big'"),
        (["run", "probe", "-p", "size"], "-p takes NAME=VALUE"),
        (["run", "probe", "--device", "tpu"], "--device 'tpu'"),
    ]
    if not torch.cuda.is_available():
        cases.append((["run", "probe", "--device", "cuda"], "CUDA is not available"))
    return cases


@pytest.mark.parametrize(("argv", "message"), refused_cases())
def test_cli_refuses_before_anything_runs(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*argv, "--notebooks-dir", str(NOTEBOOKS), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_an_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", "probe", "--notebooks-dir", str(NOTEBOOKS), "--out", str(blocker / "results")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_cli_list_shows_parameters_defaults_and_quick(capsys):
    assert main(["list", "--notebooks-dir", str(NOTEBOOKS)]) == 0
    listing = capsys.readouterr().out
    assert "size: int = 1000" in listing and "quick: 10" in listing
    assert "engines: list[str] = ['manual']" in listing


@pytest.mark.slow
def test_cli_runs_notebooks_records_a_failure_and_keeps_the_rest(tmp_path, capsys):
    argv = ["run", "probe", "failing", "--quick", "--device", "cpu", "--no-progress",
            "-p", "label=hello", "-p", "scale=2", "-p", "engines=['a', 'b']",
            "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)]
    assert main(argv) == 1
    (run_dir,) = tmp_path.iterdir()
    output = capsys.readouterr().out
    assert "failing" in output and "RuntimeError: deliberate failure on cpu" in output
    assert f"results: {run_dir}" in output

    info = load_run_info(run_dir)
    assert info["ended_at"] and info["quick"] is True and info["device"] == "cpu"
    failing, probe = info["notebooks"]["failing"], info["notebooks"]["probe"]
    assert failing["status"] == "failed" and failing["error"] == "RuntimeError: deliberate failure on cpu"
    assert probe["status"] == "ok" and probe["error"] is None
    assert probe["parameters"] == {"size": 10, "scale": 2.0, "label": "hello", "engines": ["a", "b"],
                                   "device": "cpu", "results_dir": str(run_dir.resolve())}
    assert (run_dir / "notebooks" / "failing.ipynb").is_file() and (run_dir / "notebooks" / "probe.ipynb").is_file()
    assert (run_dir / "figures" / "probe_sizes.html").is_file()

    records = load_records(run_dir)
    assert sorted(records["variant"]) == ["a", "b"] and set(records["run_id"]) == {run_dir.name}
    assert records["value"].tolist() == [20.0, 20.0]  # QUICK size 10 times scale 2
    seen = json.loads(records["params"].iloc[0])
    assert seen["label"] == "hello" and seen["scale"] == 2.0
    assert seen["executable"] == sys.executable  # the kernel is the runner's own Python


@pytest.mark.slow  # its run's environment asks git for the commit
def test_interrupt_keeps_what_was_written(tmp_path, monkeypatch, capsys):
    import papermill

    def interrupted(input_path, output_path, **kwargs):
        Path(output_path).write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(papermill, "execute_notebook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(["failing", "probe"], device="cpu", out=tmp_path, notebooks_dir=NOTEBOOKS, progress=False)
    (run_dir,) = tmp_path.iterdir()
    notebooks = load_run_info(run_dir)["notebooks"]
    assert notebooks["failing"]["status"] == "interrupted" and notebooks["probe"]["status"] == "not run"
    assert "interrupted" in capsys.readouterr().out
    assert main(["run", "failing", "--device", "cpu", "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)]) == 130


@pytest.mark.slow  # its run's environment asks git for the commit
def test_cli_runs_lists_past_runs(tmp_path, capsys):
    from benchlib.records import Run

    assert main(["runs", "--out", str(tmp_path)]) == 0
    assert "no runs yet" in capsys.readouterr().out
    made = Run.create(tmp_path, "cpu")
    assert main(["runs", "--out", str(tmp_path)]) == 0
    assert made.run_id in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), ([], 2), *([[command, "--help"], 0] for command in
                                              ("run", "list", "new", "runs", "compare", "report", "merge-records"))])
def test_help_prints_and_exits_as_argparse_does(argv, code, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == code
    captured = capsys.readouterr()
    assert "usage: benchlib" in captured.out + captured.err


@pytest.mark.slow
def test_a_budget_gives_the_kernel_a_deadline_within_it(tmp_path):
    started = time.time()
    result = run(["probe"], quick=True, device="cpu", progress=False, notebooks_dir=NOTEBOOKS, out=tmp_path,
                 budget_s=600, stream=io.StringIO())
    assert result.exit_code == 0
    (deadline,) = load_records(result.path)["params"].map(lambda p: json.loads(p)["deadline"])
    assert started < float(deadline) <= started + 600  # its share, less the reserve for figures
    assert load_run_info(result.path)["budget_s"] == 600


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_spent_budget_lists_every_notebook_as_not_run(tmp_path):
    stream = io.StringIO()
    result = run(["probe", "failing"], quick=True, device="cpu", progress=False, notebooks_dir=NOTEBOOKS,
                 out=tmp_path, budget_s=1e-9, stream=stream)
    assert [(r.name, r.status) for r in result.notebooks] == [("probe", "not run"), ("failing", "not run")]
    assert result.exit_code == 1  # not everything asked for was measured
    assert "the --budget was spent before it started" in stream.getvalue()
    assert {entry["status"] for entry in load_run_info(result.path)["notebooks"].values()} == {"not run"}


@pytest.mark.parametrize("argv", [["--budget", "0"], ["--budget", "-1"], ["--budget", "5", "--executor", "dask"]])
def test_cli_refuses_a_budget_it_cannot_keep(argv, tmp_path, capsys):
    assert main(["run", "probe", *argv, "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path / "out")]) == 2
    assert "--budget" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_unknown_isolation_mode_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BENCHLIB_ISOLATION", "threads")
    assert main(["run", "probe", "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path / "out")]) == 2
    assert "BENCHLIB_ISOLATION='threads': valid values are fork, spawn" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_notebook_that_measured_nothing_because_no_engine_applies_is_failed_never_ok():
    from benchlib.runner.outcomes import CaseOutcomes

    no_gpu = ("torch-offload (step): moves saved activations to the host: needs a CUDA device",)
    status, error = CaseOutcomes([], [], 0, measured=0, inapplicable=no_gpu).judged()
    assert status == "failed" and error.startswith("nothing was measured: no engine asked applies (torch-offload")
    assert CaseOutcomes([], [], 0, measured=12, inapplicable=no_gpu).judged() == ("ok", None)  # others measured
    assert CaseOutcomes(["x (step): boom"], [], 0, measured=3).judged()[0] == "partial"
    assert CaseOutcomes(["x (step): boom"], [], 0, measured=0).judged() == ("failed", "1 case(s) failed: x (step): boom")
    assert CaseOutcomes([], [], 0).judged() == ("ok", None)
