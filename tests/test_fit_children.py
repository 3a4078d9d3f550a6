"""`fit` never runs the user's code in its own process: a loss that kills its process, exits or hangs costs the
child that ran it (named in the output), never fit and what it measured; reading the file keeps `run`'s form-check
time limit. Each case runs `benchlib fit` as a user would, in a process of its own, so a failure here cannot take
the test run down with it."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

HOSTILE = """
import os, signal, sys, time
import torch

NAME = "hostile"
PARAMETERS = {"n": 64}
MODE = os.environ["HOSTILE_MODE"]
if MODE == "sleep at import":
    time.sleep(600)

def model(n):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

def batch(n):
    return torch.randn(n, 8), torch.randn(n, 1)

def loss(model, x, y):
    with open(os.environ["HOSTILE_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if x.shape[0] > 100:  # a batch past what the machine holds, as the OOM killer would end it
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif MODE == "exit":
            sys.exit(0)
        elif MODE == "sleep":
            time.sleep(600)
        elif MODE == "exit under autocast" and torch.is_autocast_enabled("cpu"):  # one engine's step only
            sys.exit(0)
    return ((model(x) - y) ** 2).mean()
"""


def _fit(tmp_path, mode: str, *args: str, timeout: float = 300, env: dict | None = None):
    path = tmp_path / "hostile.py"
    path.write_text(textwrap.dedent(HOSTILE))
    pids = tmp_path / "pids"
    process = subprocess.Popen([sys.executable, "-m", "benchlib.runner.cli", "fit", str(path), "--memory", "2GB",
                                "--engines", "torch", "--out", str(tmp_path / "out"), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HOSTILE_MODE": mode, "HOSTILE_PIDS": str(pids), **(env or {})})
    out, _ = process.communicate(timeout=timeout)
    called = {int(line) for line in pids.read_text().split()} if pids.exists() else set()
    return process.returncode, out, process.pid, called


@pytest.mark.slow
def test_a_loss_that_kills_its_process_past_a_batch_costs_its_children_never_fit(tmp_path):
    # the grid (8..64) holds; traces reach 8x the largest point and the search goes past 100: those children die
    code, out, pid, called = _fit(tmp_path, "kill", "--scale", "n", "--no-verify")
    assert code in (0, 1), out  # not -9: fit itself is never killed
    assert "killed by SIGKILL" in out and "not traced" in out
    assert called and pid not in called  # the loss ran, and never in fit's own process
    (run,) = (tmp_path / "out").iterdir()
    assert (run / "records.parquet").is_file() and (run / "report.html").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("mode, said", [("exit", "exited with status"), ("sleep", "timed out after 5 s")])
def test_a_loss_that_exits_or_hangs_fails_that_engine_within_the_timeout(tmp_path, mode, said):
    code, out, pid, called = _fit(tmp_path, mode, "--at", "n=200", "--timeout", "5", timeout=120)
    assert code == 1, out  # no engine fits: the one there is failed, and says how
    assert f"torch failed: the child process {said}" in out or f"torch failed: {said}" in out
    assert pid not in called
    assert (tmp_path / "out").is_dir()


@pytest.mark.slow
def test_an_answer_without_an_engine_whose_step_failed_exits_one_and_records_the_failure(tmp_path):
    from benchlib.records import load_records, load_run_info

    code, out, _, _ = _fit(tmp_path, "exit under autocast", "--at", "n=200", "--engines", "torch,torch-autocast",
                           timeout=180)
    assert code == 1, out  # torch fits, but an engine asked for failed: never exit 0
    assert "torch-autocast failed: the child process exited with status" in out and "torch " in out
    assert "benchlib: 1 engine(s) failed: torch-autocast (each line says why)" in out
    (run,) = (tmp_path / "out").iterdir()
    assert load_run_info(run)["notebooks"]["hostile_fit_at"]["status"] == "partial"
    records = load_records(run)
    assert set(records[records["metric"] == "failed"]["variant"]) == {"torch-autocast"}  # failed, not "not applicable"
    assert not (records["metric"] == "not_applicable").any()


@pytest.mark.slow
def test_a_file_that_hangs_at_import_is_refused_within_the_form_checks_limit(tmp_path):
    code, out, _, _ = _fit(tmp_path, "sleep at import", "--at", "n=8", timeout=60,
                           env={"BENCHLIB_FORM_CHECK_TIMEOUT": "3"})
    assert code == 2 and "the form check did not finish within 3 s" in out


@pytest.mark.slow
@pytest.mark.serial  # the interrupt is timed by the child's progress
def test_ctrl_c_during_a_fit_keeps_every_point_measured_before_it(tmp_path):
    import signal

    path = tmp_path / "hostile.py"
    path.write_text(textwrap.dedent(HOSTILE).replace("x.shape[0] > 100", "x.shape[0] > 20")
                    .replace('PARAMETERS = {"n": 64}', 'PARAMETERS = {"n": 64}\nQUICK = {"n": 4}'))
    # Ctrl-C as a terminal delivers it: a suite started in the background (CI) runs with SIGINT ignored, which a
    # child would inherit
    process = subprocess.Popen([sys.executable, "-m", "benchlib.runner.cli", "fit", str(path), "--memory", "2GB",
                                "--engines", "torch", "--scale", "n", "--out", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HOSTILE_MODE": "sleep", "HOSTILE_PIDS": str(tmp_path / "pids")},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, pids = [], tmp_path / "pids"
    for line in process.stdout:  # n=8 and n=16 are measured; n=32's loss sleeps: stop the fit there
        seen.append(line)
        if "hostile torch n=16:" in line:
            # Ctrl-C once n=32's child is in its loss, as a user stops a long measurement
            called = len(pids.read_text().split())
            for _ in range(600):
                if len(pids.read_text().split()) > called:
                    break
                time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            break
    try:
        out = "".join(seen) + process.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:  # say what it printed and where it was, then end it and its children
        import psutil

        children = [" ".join(child.cmdline())[:160] for child in psutil.Process(process.pid).children(recursive=True)]
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        pytest.fail(f"fit did not end 120 s after Ctrl-C; its processes: {children}; it printed:\n"
                    + "".join(seen) + process.communicate()[0])
    assert process.returncode == 130, out
    assert "interrupted: what was measured is in" in out
    (run,) = (tmp_path / "out").iterdir()
    from benchlib.records import load_records
    from benchlib.records.store import load_run_info

    records = load_records(run)
    measured = records[records["metric"] == "fit_total_bytes"]
    assert sorted(measured["params"].map(lambda p: __import__("json").loads(p)["value"])) == [8, 16]
    assert load_run_info(run)["interrupted"] is True and (run / "report.html").is_file()
    assert load_run_info(run)["interrupted_by"] == "KeyboardInterrupt"  # as a run's says (before: None)


@pytest.mark.slow  # its run directory's environment asks git
@pytest.mark.parametrize("question", [["--scale", "n"], ["--at", "n=8"]])
def test_an_interrupt_before_the_first_point_is_measured_exits_130_with_the_run_marked_interrupted(
        tmp_path, monkeypatch, capsys, question):
    import benchlib.fit
    from benchlib.fit import FitInterrupted
    from benchlib.fit.at import AtResult
    from benchlib.fit.result import FitResult
    from benchlib.records.store import load_run_info
    from benchlib.runner.cli import main

    nothing = FitResult("hostile", "n", 10**9, "cpu", "total", []) if question[0] == "--scale" else \
        AtResult("hostile", "n", 8, 10**9, 0.0, "cpu", "total")

    def stopped(*args, **kwargs):
        raise FitInterrupted(nothing, "SIGINT")

    monkeypatch.setattr(benchlib.fit, "fit" if question[0] == "--scale" else "fit_at", stopped)
    path = tmp_path / "hostile.py"
    path.write_text("PARAMETERS = {'n': 64}\n")
    assert main(["fit", str(path), "--memory", "2GB", *question, "--out", str(tmp_path / "out")]) == 130
    assert "interrupted: before anything was measured; the run, marked so, is" in capsys.readouterr().err
    (run,) = (tmp_path / "out").iterdir()
    info = load_run_info(run)
    assert info["interrupted"] is True and info["ended_at"] is not None and info["interrupted_by"] == "SIGINT"
    assert not (run / "records.parquet").exists() and (run / "report.html").is_file()
