"""Runs that fail visibly, refuse bad values before any kernel starts, survive bad files and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from benchlib.measure.case_child import CASE_PROCESS_NAME  # a case's process, forked or a fresh interpreter
from benchlib.records import Run, list_runs, load_records, load_run_info, make_record
from benchlib.records.store import RecordsUnreadable, run_state
from benchlib.runner import run
from benchlib.runner.cli import main
from benchlib.runner.outcomes import case_outcomes, last_duration

NOTEBOOKS = Path(__file__).parent / "notebooks"
PROJECT = Path(__file__).parents[1]


def cli(*argv, out):
    return main([*argv, "--device", "cpu", "--notebooks-dir", str(NOTEBOOKS), "--out", str(out)])


# ---------------------------------------------------------------- a failing case is never ok


@pytest.mark.slow
def test_a_notebook_whose_cases_partly_failed_is_partial_and_the_run_exits_1(tmp_path, capsys):
    assert cli("run", "cases", "-p", "failing=torch", out=tmp_path) == 1
    (run_dir,) = tmp_path.iterdir()
    entry = load_run_info(run_dir)["notebooks"]["cases"]
    assert entry["status"] == "partial"
    assert entry["failed_cases"] == ["torch (c): case 'cases/c/torch' failed: the child raised RuntimeError: "
                                     "torch fails on purpose"]
    assert entry["error"].startswith("1 case(s) failed: torch (c)")
    assert entry["benchmarks"] == ["cases"]  # the records it wrote: what the report's section holds
    summary = capsys.readouterr().out
    assert "partial" in summary and "torch fails on purpose" in summary
    assert set(load_records(run_dir)["variant"]) == {"manual", "torch"}  # manual's measurement is kept
    assert [row["state"] for _, row in list_runs(tmp_path).iterrows()] == ["finished"]
    assert list_runs(tmp_path)["failed"].tolist() == [1]


@pytest.mark.slow
def test_a_notebook_whose_cases_all_failed_stops_with_the_first_cases_error(tmp_path):
    # the baseline (manual) alone: any other engine list gets it added, and it would run
    assert cli("run", "cases", "-p", "engines=['manual']", "-p", "failing=manual", out=tmp_path) == 1
    (run_dir,) = tmp_path.iterdir()
    entry = load_run_info(run_dir)["notebooks"]["cases"]
    assert entry["status"] == "failed"
    assert entry["error"].startswith("AllCasesFailed: cases: all 1 case(s) failed; the first, manual (c)")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_case_outcomes_read_failures_and_data_sources_from_the_records_a_notebook_saved(tmp_path):
    run_ = Run.create(tmp_path, "cpu")
    since = time.time() - 1
    common = dict(benchmark="b", device="cpu", dtype="float32")
    run_.save_records([make_record(case="c1", engine="e", metric="time", value=1.0, params={"data": "synthetic"}, **common),
                       make_record(case="c2", engine="f", metric="failed", value=1.0,
                                   params={"message": "boom\ntraceback..."}, **common),
                       make_record(case="c3", engine="g", metric="not_run", value=1.0,
                                   params={"message": "the budget ran out"}, **common)], "b")
    failures, sources, not_run, measured, benchmarks, inapplicable = case_outcomes(run_.path, since)
    assert failures == ["f (c2): boom"] and sources == ["synthetic"] and not_run == 1 and measured == 1
    assert benchmarks == ("b",) and inapplicable == ()
    assert case_outcomes(run_.path, time.time() + 60) == ([], [], 0, 0, (), ())  # earlier notebooks' fragments: unread


# ---------------------------------------------------------------- refused while planning


def refuse_kernels(monkeypatch):
    import papermill

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was started for a run that should have been refused")

    monkeypatch.setattr(papermill, "execute_notebook", no_kernel)


@pytest.mark.parametrize(("notebook", "params", "message"), [
    ("dot_chain", ["-p", "depth=0"], "depth must be an integer >= 1, got 0"),
    ("dot_chain", ["-p", "D=200000"], "dot_chain: these sizes need about 72960.00 GB, but"),
    ("dot_chain", ["-p", "dtype=float16"], "dtype must be one of float32, float64, got 'float16'"),
    ("dot_chain", ["-p", "engines=[]"], "dot_chain: engines must be a non-empty list, each one of manual"),
    ("dot_chain", ["-p", "engines=['jax']"], "got ['jax'] ('jax' is not valid)"),
    ("dot_chain", ["-p", "malloc=big"], "malloc must be one of mmap-128k, mmap-64k, glibc-default, training-process, got 'big'"),
    ("rnn_fanout", ["-p", "T_sweep=[0]"], "T_sweep must be a non-empty list, each an integer >= 1, got [0] (0 is not valid)"),
    ("identical_closures", ["-p", "backend=foo"], "backend must be one of"),
    ("mnist_ensembles", ["-p", "synthetic_n=100000000"], "mnist_ensembles: these sizes need about"),
    ("mnist_ensembles", ["-p", "gc_policies=['sometimes']"], "gc_policies must be a non-empty list, each one of default, freeze, thresholds, manual, got ['sometimes']"),
    ("mnist_ensembles", ["-p", "cycles=[0, 1000000]"], "mnist_ensembles: these sizes need about"),
    ("mnist_ensembles", ["-p", "cycles=[-1]"], "cycles must be a non-empty list, each an integer >= 0, got [-1] (-1 is not valid)"),
    ("calibration", ["-p", "copy_mib=-1"], "copy_mib must be an integer >= 1, got -1"),
    ("dot_chain", ["-p", "depth=1", "-p", "depth=2"], "-p depth is given twice ('1' and '2')"),
])
def test_bad_values_are_refused_with_exit_2_before_a_kernel_starts(notebook, params, message, tmp_path, monkeypatch,
                                                                   capsys):
    refuse_kernels(monkeypatch)
    out = tmp_path / "out"
    code = main(["run", notebook, *params, "--device", "cpu", "--out", str(out)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # its run's environment asks git for the commit
def test_out_inside_a_run_and_a_missing_results_root_are_refused(tmp_path, capsys):
    made = Run.create(tmp_path, "cpu")
    assert cli("run", "probe", out=made.path / "nested") == 2
    assert "is inside the run" in capsys.readouterr().err
    assert main(["runs", "--out", str(tmp_path / "typo")]) == 2
    assert "no results directory" in capsys.readouterr().err


# ---------------------------------------------------------------- notebooks given as paths


@pytest.mark.slow
def test_a_notebook_path_runs_that_file_never_the_projects_namesake(tmp_path, capsys):
    import nbformat

    edited = tmp_path / "mine" / "probe.ipynb"
    edited.parent.mkdir()
    notebook = nbformat.read(NOTEBOOKS / "probe.ipynb", as_version=4)
    notebook.cells[1].source += "\nextra = 5"
    nbformat.write(notebook, edited)
    assert main(["run", str(edited), "-p", "extra=7", "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    entry = load_run_info(run_dir)["notebooks"]["probe"]
    assert entry["path"] == str(edited.resolve()) and entry["parameters"]["extra"] == 7
    assert main(["run", str(tmp_path / "mine" / "missing.ipynb"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- bad files are named, listed, rebuilt


def corrupt(path: Path) -> None:
    path.write_bytes(b"PAR1" + os.urandom(64) + b"PAR1")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_corrupt_records_file_is_named_listed_and_rebuilt_from_fragments(tmp_path, capsys):
    good = Run.create(tmp_path, "cpu")
    good.save_records([make_record(benchmark="b", case="c", engine="e", device="cpu", dtype="float64",
                                   metric="time", value=2.0, unit="s")], "b")
    corrupt(good.path / "records.parquet")
    broken_info = tmp_path / "broken-run"
    broken_info.mkdir()
    (broken_info / "run.json").write_text("{not json")

    with pytest.raises(RecordsUnreadable, match=r"records\.parquet: cannot read records"):
        load_records(good.path)
    runs = list_runs(tmp_path).set_index("run_id")
    assert "records.parquet unreadable" in runs.loc[good.run_id, "problem"]
    assert runs.loc["broken-run", "state"] == "unreadable" and "cannot read run.json" in runs.loc["broken-run", "problem"]
    assert main(["runs", "--out", str(tmp_path)]) == 1  # answered, and some runs cannot be read
    listing = capsys.readouterr()
    assert good.run_id in listing.out and "broken-run" in listing.out
    assert "2 run(s) with files that cannot be read" in listing.err

    assert main(["merge-records", str(good.path)]) == 0
    assert load_records(good.path)["value"].tolist() == [2.0]
    corrupt(good.path / "records" / "b.parquet")
    assert main(["merge-records", str(good.path)]) == 1
    assert "b.parquet: cannot read records" in capsys.readouterr().err


@pytest.mark.slow
def test_a_running_entry_whose_runner_is_gone_is_shown_as_stale():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    import socket

    assert run_state({"ended_at": None, "runner": {"pid": gone.pid, "host": socket.gethostname()}}) == "stale: runner gone"
    assert run_state({"ended_at": None, "runner": {"pid": os.getpid(), "host": socket.gethostname()}}) == "running"
    assert run_state({"ended_at": "t", "interrupted": True}) == "interrupted"


# ---------------------------------------------------------------- signals, orphans, the terminal


@pytest.mark.slow
def test_sigterm_finishes_run_json_as_interrupted_and_leaves_no_case_child(tmp_path):
    runner = subprocess.Popen(
        [sys.executable, "-m", "benchlib.runner.cli", "run", "cases", "-p", "sleep_s=120", "--device", "cpu",
         "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    case_child = wait_for_descendant(runner, CASE_PROCESS_NAME, timeout_s=90)  # the long case started
    runner.send_signal(signal.SIGTERM)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 130, output
    (run_dir,) = tmp_path.iterdir()
    info = load_run_info(run_dir)
    assert info["ended_at"] and info["interrupted"] is True and info["interrupted_by"] == "SIGTERM"
    assert info["notebooks"]["cases"]["status"] == "interrupted"
    assert not psutil.pid_exists(case_child.pid) or case_child.status() == psutil.STATUS_ZOMBIE
    assert "without encryption" not in output  # kernels speak over IPC sockets, not TCP


@pytest.mark.slow
def test_sigterm_while_a_model_file_is_checked_stops_with_130_a_message_and_no_checking_child(tmp_path):
    model_file = tmp_path / "slow_import.py"  # the check's child imports it: 60 s at module level
    model_file.write_text("import time\nimport torch\n\ntime.sleep(60)\n\n\ndef model():\n    return torch.nn.Linear(2, 1)\n\n\n"
                          "def batch():\n    return torch.ones(3, 2)\n\n\ndef loss(model, x):\n    return model(x).sum()\n")
    runner = subprocess.Popen([sys.executable, "-m", "benchlib.runner.cli", "run", str(model_file), "--out", str(tmp_path / "out")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checking = wait_for_descendant(runner, "benchlib.usermodel.reading", timeout_s=60)
    runner.send_signal(signal.SIGTERM)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 130, output  # before: 143, killed by the default action, no word said
    assert "benchlib: stopped by SIGTERM" in output and "Traceback" not in output
    assert gone(checking)


@pytest.mark.slow  # its run's environment asks git for the commit
def test_typed_parameters_in_run_json_and_the_eta_basis(tmp_path, monkeypatch):
    import papermill

    def executes(input_path, output_path, **kwargs):
        time.sleep(0.05)
        Path(output_path).write_text("{}")

    monkeypatch.setattr(papermill, "execute_notebook", executes)
    result = run(["probe"], device="cpu", params={"size": "12", "label": "123"}, out=tmp_path,
                 notebooks_dir=NOTEBOOKS, progress=False)
    info = load_run_info(result.path)
    assert info["params"] == {"size": 12, "label": "123"}  # typed as the notebook declares them
    assert last_duration(tmp_path, "probe", quick=False) == info["notebooks"]["probe"]["duration_s"]
    assert last_duration(tmp_path, "probe", quick=True) is None


def test_the_default_results_root_is_the_projects_from_any_directory(tmp_path, monkeypatch):
    from benchlib.records import default_results_root

    monkeypatch.delenv("BENCHLIB_RESULTS")
    monkeypatch.chdir(tmp_path)
    assert default_results_root() == PROJECT / "results"


def test_sighup_and_sigterm_raise_the_interrupt_that_finishes_a_run_and_handlers_are_restored():
    from benchlib.runner.interrupts import Terminated, terminate_as_interrupt

    before = signal.getsignal(signal.SIGHUP)
    for name in ("SIGHUP", "SIGTERM"):
        with pytest.raises(Terminated) as caught, terminate_as_interrupt():
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(5)  # the handler raises at the next bytecode; this sleep is interrupted at once
        assert caught.value.signal_name == name and isinstance(caught.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGHUP) == before


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def _command_line(process: psutil.Process) -> str:
    """The process's command line, or "" for one that has just exited (a zombie not yet reaped,
    or already gone): a short-lived helper of the kernel must not fail the search."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def wait_for_descendant(parent: subprocess.Popen, marker: str, timeout_s: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((p for p in psutil.Process(parent.pid).children(recursive=True)
                      if marker in _command_line(p) or marker == _name(p)), None)
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no descendant running {marker!r} appeared")


def gone(process: psutil.Process, timeout_s: float = 30) -> bool:
    try:
        process.wait(timeout=timeout_s)
    except psutil.TimeoutExpired:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_case_child_dies_with_the_process_that_started_it_even_when_that_is_killed_outright(tmp_path):
    tests = str(Path(__file__).parent)
    started = tmp_path / "grandchild.pid"  # written from inside the measured call: the case is running
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import sys; sys.path.insert(0, {tests!r})\n"
        "from benchlib.measure import IsolationOptions, run_isolated\n"
        "run_isolated('isolation_targets:spawns_sleeper', {'seconds': 120}, name='sleeper',\n"
        "             options=IsolationOptions(timeline=False))")],
        env={**os.environ, "GRANDCHILD_PID_FILE": str(started), "TMPDIR": str(tmp_path)})  # the killed parent's
    child = wait_for_descendant(parent, CASE_PROCESS_NAME)  # temporary folder is left in tmp_path, not in /tmp
    deadline = time.monotonic() + 60
    while not (started.is_file() and started.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.is_file(), "the case never reached its measured call"
    parent.kill()  # SIGKILL: no finally block, no handler; only the kernel's parent-death signal is left
    parent.wait()
    try:
        assert gone(child), f"case child {child.pid} outlived its killed parent"
    finally:
        psutil.Process(int(started.read_text())).kill()  # the grandchild is the runner's to reap, not this test's


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers are Linux's")
def test_the_runner_reaps_what_a_dead_kernel_left_behind(tmp_path):
    script = (
        "import subprocess, sys\n"
        "from benchlib.runner.kernels import become_subreaper, reap_orphans\n"
        "assert become_subreaper()\n"
        # a 'kernel' that starts a long computation, then dies without stopping it
        "kernel = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; "
        "print(subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(120)\"]).pid)'], "
        "stdout=subprocess.PIPE, text=True)\n"
        "orphan = int(kernel.stdout.readline())\n"
        "kernel.wait()\n"
        "reaped = reap_orphans()\n"
        "print(orphan, orphan in reaped)\n")
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert output.returncode == 0, output.stderr
    orphan, reaped = output.stdout.split()
    assert reaped == "True"
    assert not psutil.pid_exists(int(orphan)) or psutil.Process(int(orphan)).status() == psutil.STATUS_ZOMBIE


def test_progress_lines_carry_the_notebook_elapsed_time_and_time_left():
    import io

    from benchlib.runner.kernels import ProgressLines

    shown = io.StringIO()
    lines = ProgressLines("dot_chain", shown, expected_s=3600)
    lines.write("dot_chain D=64 manual: 1.0 ms\ndot_chain D=64 tor")
    lines.write("ch: 2.0 ms\n\n")
    printed = shown.getvalue().splitlines()
    assert len(printed) == 2 and all(line.startswith("    dot_chain 0:0") for line in printed)
    assert all("left |" in line for line in printed)
    assert printed[1].endswith("| dot_chain D=64 torch: 2.0 ms")
    unknown = io.StringIO()
    ProgressLines("new", unknown, expected_s=None).write("step\n")
    assert "left" not in unknown.getvalue() and unknown.getvalue().endswith("| step\n")


@pytest.mark.slow
@pytest.mark.skipif(subprocess.run(["which", "make"], capture_output=True).returncode != 0, reason="no make")
def test_make_lab_opens_working_copies_and_passes_args_to_jupyter():
    stamp = ".venv/.benchlib-installed"
    shown = subprocess.run(["make", "-n", "-o", stamp, "lab", "ARGS=--no-browser --port 8899"],
                           cwd=PROJECT, capture_output=True, text=True, check=True).stdout
    (command,) = [line for line in shown.splitlines() if "benchlib lab" in line]
    assert "benchlib lab --dir lab -- --no-browser --port 8899" in command  # benchlib adds --allow-root as root


def test_a_declaration_checks_values_and_the_memory_the_named_device_has():
    from benchlib.benchmark import ParameterError
    from benchlib.measure import resolve_device
    from benchlib.registry import get

    dot_chain = {"dtype": "float64", "engines": ["manual", "torch"], "repeats": 1, "warmup": 0, "malloc": "mmap-128k",
                 "D": 200_000, "depth": 100}
    get("dot_chain").config(dot_chain)  # no device named: sizes are not weighed against memory
    with pytest.raises(ParameterError, match=r"dot_chain: these sizes need about "
                                             r"\d+\.\d+ GB, but \d+\.\d+ GB are available on cpu"):
        get("dot_chain").config(dot_chain, device=resolve_device("cpu"))
    with pytest.raises(ParameterError, match="dot_chain: depth must be an integer >= 1, got 0"):
        get("dot_chain").config({**dot_chain, "depth": 0})


def two_row_run(tmp_path) -> Run:
    run_ = Run.create(tmp_path, "cpu")
    for benchmark in ("a", "b"):
        run_.save_records([make_record(benchmark=benchmark, case="c", engine="e", device="cpu", dtype="float64",
                                       metric="time", value=1.0, unit="s")], benchmark)
    return run_


@pytest.mark.slow  # its run's environment asks git for the commit
def test_unstamped_records_in_todays_columns_are_read_and_an_empty_table_is_reported_as_no_measurement(tmp_path,
                                                                                                    capsys):
    run_ = two_row_run(tmp_path)
    records = load_records(run_.path)
    records.to_parquet(run_.path / "records.parquet")  # pandas' own writer: no schema stamp
    assert len(load_records(run_.path)) == 2  # before: "schema version 1 records need `benchmark` and `engine`..."
    records.iloc[:0].to_parquet(run_.path / "records.parquet")
    assert main(["report", str(run_.path)]) == 1  # before: 0, and an empty page said nothing
    err = capsys.readouterr().err
    assert "benchlib: the page shows no measurement" in err and "its records hold no row" in err
    assert "schema version 1" not in err and (run_.path / "report.html").is_file()


@pytest.mark.slow  # its run's environment asks git for the commit
def test_merge_records_never_replaces_records_parquet_with_fewer_rows(tmp_path, capsys):
    run_ = two_row_run(tmp_path)
    corrupt(run_.path / "records" / "b.parquet")
    assert main(["merge-records", str(run_.path)]) == 1
    err = capsys.readouterr().err
    assert "b.parquet: cannot read records" in err and "kept" in err
    assert len(load_records(run_.path)) == 2

    for fragment in (run_.path / "records").iterdir():
        fragment.unlink()
    (run_.path / "records").rmdir()
    assert main(["merge-records", str(run_.path)]) == 2
    assert "nothing to merge" in capsys.readouterr().err
    assert len(load_records(run_.path)) == 2
    assert not [path for path in run_.path.iterdir() if path.name.endswith(".tmp")]


# ---------------------------------------------------------------- --timeout


def sleeper_notebook(folder: Path) -> Path:
    """A notebook that saves one record, then sleeps for `seconds`."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell('device = "auto"\nresults_dir = ""\nseconds = 0.0')
    parameters.metadata["tags"] = ["parameters"]
    notebook.cells = [
        parameters,
        nbformat.v4.new_code_cell(
            "from benchlib.records import Run, make_record\n"
            "Run.open(results_dir, device=device).save_records([make_record(benchmark='sleeper', case='c', engine='e', "
            "device='cpu', dtype='float64', metric='time', value=1.0, unit='s')], 'sleeper')"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(seconds)"),
    ]
    nbformat.write(notebook, folder / "sleeper.ipynb")
    return folder / "sleeper.ipynb"


@pytest.mark.slow
def test_a_notebook_past_its_timeout_is_timed_out_keeps_its_records_and_the_others_run(tmp_path, capsys):
    import shutil

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    sleeper_notebook(notebooks)
    shutil.copy(NOTEBOOKS / "probe.ipynb", notebooks)
    started = time.monotonic()
    assert main(["run", "sleeper", "probe", "-p", "seconds=600", "--timeout", "30", "--device", "cpu",
                 "--notebooks-dir", str(notebooks), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    assert time.monotonic() - started < 300
    (run_dir,) = (tmp_path / "out").iterdir()
    entries = load_run_info(run_dir)["notebooks"]
    assert entries["sleeper"]["status"] == "timed out" and "--timeout of 30 s" in entries["sleeper"]["error"]
    assert entries["probe"]["status"] == "ok"
    assert set(load_records(run_dir)["benchmark"]) == {"sleeper", "probe"}  # the sleeper's record before the limit
    assert "timed out" in capsys.readouterr().out


HANGS_UNDER_AUTOCAST = """
import time
import torch
PARAMETERS = {"width": 16}
def model(width):
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
def batch(width):
    return (torch.randn(4, 8),)
def loss(model, x):
    if torch.is_autocast_enabled("cpu"):  # one engine's step never ends
        time.sleep(600)
    return model(x).square().mean()
"""


@pytest.mark.slow
def test_a_case_that_hangs_fails_named_within_the_timeout_and_the_trials_before_it_are_kept(tmp_path, capsys):
    (tmp_path / "hangs.py").write_text(HANGS_UNDER_AUTOCAST)
    assert main(["run", str(tmp_path / "hangs.py"), "--quick", "--timeout", "30", "-p", "engines=torch,torch-autocast",
                 "-p", "trials=1", "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    (run_dir,) = (tmp_path / "out").iterdir()
    entry = load_run_info(run_dir)["notebooks"]["hangs"]
    assert entry["status"] == "partial" and "torch-autocast" in entry["error"]  # it finished, naming what hung
    records = load_records(run_dir)
    failed = records[records["metric"] == "failed"]
    assert set(failed["variant"]) == {"torch-autocast"}
    assert "(all the run's --timeout or --budget left it)" in failed["params"].iloc[0]
    assert {"time", "peak_bytes"} <= set(records[records["variant"] == "torch"]["metric"])  # measured before it


@pytest.mark.slow
@pytest.mark.parametrize("cut_by, code, status", [("--timeout", 1, "partial"), ("--budget", 0, "ok")])
def test_cases_a_timeout_left_no_time_for_make_the_notebook_partial_and_name_the_timeout(cut_by, code, status,
                                                                                         tmp_path, capsys, monkeypatch):
    """A --timeout is a safety limit: engines it left unmeasured are a partial run (exit 1) that names it. Under
    --budget, leaving cases out is what was asked: listed, and the notebook stays ok."""
    from benchlib.runner.execute import _RunLoop

    monkeypatch.setattr(_RunLoop, "_measuring_deadline", lambda self, index: (time.time() - 1, cut_by))  # spent
    (tmp_path / "small.py").write_text(HANGS_UNDER_AUTOCAST.replace("import time\n", "")
                                       .replace("    if torch.is_autocast_enabled", "    if False and torch.is_autocast_enabled"))
    assert main(["run", str(tmp_path / "small.py"), "--quick", "--timeout", "300", "-p", "engines=torch,torch-autocast",
                 "-p", "trials=1", "--out", str(tmp_path / "out"), "--no-progress"]) == code
    (run_dir,) = (tmp_path / "out").iterdir()
    entry = load_run_info(run_dir)["notebooks"]["small"]
    said = f"1 case(s) not run: the {cut_by} left no time for them"
    assert entry["status"] == status and entry["not_run_cases"] == 1
    assert said in capsys.readouterr().out and (status == "ok" or said in entry["error"])
    not_run = load_records(run_dir).query("metric == 'not_run'")
    assert set(not_run["variant"]) == {"torch-autocast"}  # the first child always runs: torch measured


def test_a_timeout_that_is_not_a_positive_number_is_refused(tmp_path, capsys):
    assert cli("run", "probe", "--timeout", "0", out=tmp_path / "out") == 2
    assert "--timeout must be a number of seconds > 0, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- every command: one line, the documented exit


def broken_runs(tmp_path) -> dict[str, Path]:
    """Runs each broken one way a user meets: run.json not JSON, empty records.parquet, a directory
    where records.parquet should be, no records/ at all; and a good one."""
    from benchlib.analysis.seed_verdicts import save_verdicts, seed_verdicts
    from benchlib.registry import verdict_rules

    made = {}
    for name in ("good", "bad_json", "empty_records", "records_dir", "no_fragments", "judged_garbage"):
        made[name] = two_row_run(tmp_path / name).path
    (made["bad_json"] / "run.json").write_text("{not json")
    (made["empty_records"] / "records.parquet").write_bytes(b"")
    # judged (its verdicts written, as a finished run's are) before its records were damaged
    save_verdicts(seed_verdicts(load_records(made["judged_garbage"]), verdict_rules()), made["judged_garbage"])
    (made["judged_garbage"] / "records.parquet").write_bytes(b"PAR1 not a parquet file")
    (made["records_dir"] / "records.parquet").unlink()
    (made["records_dir"] / "records.parquet").mkdir()
    for fragment in (made["no_fragments"] / "records").iterdir():
        fragment.unlink()
    (made["no_fragments"] / "records").rmdir()
    return made


@pytest.mark.slow  # its run's environment asks git for the commit
@pytest.mark.parametrize(("command", "broken", "code", "named"), [
    ("compare", "empty_records", 2, "records.parquet: cannot read records"),
    ("compare", "records_dir", 2, "records.parquet: not a file (a directory)"),
    ("report", "bad_json", 2, "run.json: cannot read run.json"),
    ("report", "empty_records", 1, "records.parquet: cannot read records"),
    ("report", "judged_garbage", 1, "records.parquet: cannot read records"),
    ("merge-records", "records_dir", 2, "records.parquet: cannot write"),
    ("merge-records", "no_fragments", 2, "holds no per-notebook records: nothing to merge"),
    ("history", "records_dir", 2, "records.parquet: not a file"),
    ("runs", "empty_records", 1, "run(s) with files that cannot be read"),
])
def test_a_broken_run_gives_one_line_naming_the_file_and_the_documented_exit(command, broken, code, named, tmp_path,
                                                                              capsys):
    runs = broken_runs(tmp_path)
    argv = {"compare": ["compare", str(runs["good"]), str(runs[broken])],
            "report": ["report", str(runs[broken])],
            "merge-records": ["merge-records", str(runs[broken])],
            "history": ["history", str(runs["good"]), str(runs[broken])],
            "runs": ["runs", "--out", str(runs[broken].parent)]}[command]
    held = {path: path.read_bytes() for path in tmp_path.rglob("*.parquet") if path.is_file()}
    assert main(argv) == code
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("benchlib:")]) == 1
    assert all(path.read_bytes() == content for path, content in held.items())  # never fewer results than found
    if command == "report" and code == 1:  # the page is written, and says at its top why it shows no measurement
        assert "could not be read" in (runs[broken] / "report.html").read_text()
    capsys.readouterr()
    if code == 2:  # the same refusal with --debug: its traceback, then the same line
        assert main([*argv, "--debug"]) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and named in err
        assert err.splitlines()[-1].startswith("benchlib: error: ")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_full_disk_is_named_and_leaves_records_as_they_were(tmp_path, monkeypatch, capsys):
    import errno

    from benchlib.records import store

    run_ = two_row_run(tmp_path)
    before = (run_.path / "records.parquet").read_bytes()

    def full(_descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store.os, "fsync", full)
    assert main(["merge-records", str(run_.path)]) == 2
    err = capsys.readouterr().err
    assert err == f"benchlib: error: {run_.path / 'records.parquet'}: cannot write: No space left on device\n"
    assert (run_.path / "records.parquet").read_bytes() == before
    assert not [path for path in run_.path.rglob("*.tmp")]
    assert main(["run", "probe", "--device", "cpu", "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path / "o")]) == 2
    assert "run.json: cannot write: No space left on device" in capsys.readouterr().err


def test_a_dangling_symlink_as_out_is_refused_naming_it(tmp_path, capsys):
    link = tmp_path / "results"
    link.symlink_to(tmp_path / "gone")
    assert cli("run", "probe", out=link) == 2
    assert f"{str(link)!r} is a symbolic link to {str(tmp_path / 'gone')!r}, which does not exist" in capsys.readouterr().err
    assert main(["runs", "--out", str(link)]) == 2
    assert "benchlib: error: no results directory" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permission bits say")
def test_an_unreadable_results_directory_is_one_line_and_exit_2(tmp_path, capsys):
    locked = tmp_path / "locked"
    two_row_run(locked)
    locked.chmod(0)
    try:
        assert main(["runs", "--out", str(locked)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"benchlib: error: {locked}: Permission denied") and "Traceback" not in err
        assert cli("run", "probe", out=locked / "new") == 2
        assert "is not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


def test_debug_is_an_option_of_every_command():
    from benchlib.runner.cli import _parser

    commands = _parser()._subparsers._group_actions[0].choices
    assert all(any("--debug" in action.option_strings for action in sub._actions) for sub in commands.values())


def test_a_file_given_where_a_directory_is_expected_is_named_as_such(tmp_path, capsys):
    a_file = tmp_path / "résultats.txt"
    a_file.write_text("")
    assert main(["list", "--notebooks-dir", str(a_file)]) == 2
    assert capsys.readouterr().err == f"benchlib: error: notebooks directory {str(a_file)!r} is a file, not a directory\n"
    assert main(["runs", "--out", str(a_file)]) == 2
    assert "no results directory" in capsys.readouterr().err


SLOW_STEP = """
import time
import torch

PARAMETERS = {"n": 4}

def model(n):
    return torch.nn.Linear(n, 1)

def batch(n):
    return (torch.randn(8, n),)

def loss(model, x):
    time.sleep(0.2)  # a slow step: trials finish one by one while the run goes on
    return model(x).square().mean()
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and the kernel's session are POSIX")
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_on_a_model_file_run_keeps_the_trials_that_finished_and_prints_no_traceback(stop, tmp_path):
    # Ctrl-C reaches the terminal's foreground group: the runner, not the kernel (a session of its own), which the
    # runner interrupts in turn and waits for, so the kernel saves its finished trials before it is shut down;
    # SIGTERM (a CI job's time-out) reaches the runner alone, and is passed on the same way
    path = tmp_path / "slow.py"
    path.write_text(SLOW_STEP)
    out = tmp_path / "out"
    runner = subprocess.Popen([sys.executable, "-m", "benchlib", "run", str(path), "-p", "engines=torch,torch-checkpoint",
                               "-p", "trials=50", "-p", "precision=0", "-p", "combinations=none", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in runner.stdout:
        lines.append(line)
        if "trial 3/50" in line:
            break
    if stop == "SIGINT":
        os.killpg(runner.pid, signal.SIGINT)
    else:
        os.kill(runner.pid, signal.SIGTERM)
    lines += runner.stdout.readlines()
    assert runner.wait(timeout=60) == 130
    output = "".join(lines)
    assert "Traceback" not in output and "interrupted" in output
    (run_dir,) = out.iterdir()
    records = load_records(run_dir)
    assert len(records[records["metric"] == "time"]) >= 3 and load_run_info(run_dir)["interrupted"] is True
    assert load_run_info(run_dir)["interrupted_by"] == ("KeyboardInterrupt" if stop == "SIGINT" else "SIGTERM")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_fifo_as_a_runs_file_is_named_as_one_under_the_root_given_never_the_default(tmp_path):
    from benchlib.records.store import resolve_run

    root = tmp_path / "elsewhere"
    (root / "piped").mkdir(parents=True)
    os.mkfifo(root / "piped" / "run.json")  # reading it would block for ever
    (row,) = list_runs(root).to_dict("records")
    assert row["state"] == "unreadable" and "run.json is a FIFO (named pipe), not a file" in row["problem"]
    assert "results" not in row["problem"]  # before: "no run ... under <the project's results/>"
    with pytest.raises(RecordsUnreadable, match="run.json is a FIFO"):
        resolve_run("piped", root)
    (root / "piped" / "run.json").unlink()
    Run._start(root / "piped", "piped", "cpu", None, {})
    os.mkfifo(root / "piped" / "records.parquet")
    (row,) = list_runs(root).to_dict("records")
    assert "records.parquet is a FIFO (named pipe), not a file" in row["problem"]
