"""A model file is read and checked in a child process: whatever its code does to a process (exit it,
hang, leave a thread running) it does to that child, and the runner refuses the file saying so."""

import pytest

from benchlib.usermodel import ModelFileError, load_model_file
from benchlib.usermodel.reading import declare_in_child

HEAD = "import torch\n\ndef model():\n    return torch.nn.Linear(2, 1)\n\ndef batch():\n    return torch.randn(3, 2)\n\n"
GOOD = HEAD + "def loss(model, x):\n    return model(x).sum()\n"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.slow
def test_the_child_declares_the_same_benchmark_as_reading_the_file_here(tmp_path):
    path = _write(tmp_path, "fine.py", GOOD.replace("import torch\n", "import torch\nPARAMETERS = {'w': [1, 2]}\n")
                  .replace("def model():", "def model(w):").replace("def batch():", "def batch(w):"))
    (declared,) = declare_in_child([[path]])
    here = load_model_file(path)
    assert declared.name == here.name == "fine" and declared.describe_parameters() == here.describe_parameters()
    assert declared.question == here.question and declared.headline == here.headline


@pytest.mark.slow
@pytest.mark.parametrize("body, expected", [
    ("def loss(model, x):\n    import os\n    os._exit(0)\n", "ended with exit status 0 before it answered"),
    ("import threading, time\nthreading.Thread(target=time.sleep, args=(600,), name='poller').start()\n"
     "def loss(model, x):\n    return model(x).sum()\n", "started thread(s) poller that are still running"),
    ("def loss(model, x):\n    return model(x)\n", "must return a 0-dim tensor"),
])
def test_a_file_whose_code_breaks_its_process_is_refused_saying_how(tmp_path, body, expected):
    good, bad = _write(tmp_path, "good.py", GOOD), _write(tmp_path, "bad.py", HEAD + body)
    answers = declare_in_child([[bad]])
    assert isinstance(answers[0], ModelFileError) and expected in str(answers[0])
    if "thread" not in expected and "exit" not in expected:  # a refusal of one group leaves the others read
        assert [type(a).__name__ for a in declare_in_child([[bad], [good]])] == ["ModelFileError", "Benchmark"]


@pytest.mark.slow
def test_a_file_that_hangs_is_refused_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHLIB_FORM_CHECK_TIMEOUT", "3")
    path = _write(tmp_path, "hangs.py", HEAD + "def loss(model, x):\n    while True:\n        pass\n")
    (answer,) = declare_in_child([[path]])
    assert isinstance(answer, ModelFileError) and "did not finish within 3 s" in str(answer)
    monkeypatch.setenv("BENCHLIB_FORM_CHECK_TIMEOUT", "soon")
    with pytest.raises(ModelFileError, match="BENCHLIB_FORM_CHECK_TIMEOUT must be a number of seconds"):
        declare_in_child([[path]])


@pytest.mark.slow
def test_benchlib_run_refuses_a_file_that_exits_the_process_with_exit_2_and_no_run(tmp_path, capsys):
    from benchlib.runner.cli import main

    path = _write(tmp_path, "exits.py", HEAD + "def loss(model, x):\n    raise SystemExit(0)\n")
    assert main(["run", path, "--out", str(tmp_path / "out")]) == 2
    assert "the process checking the file ended with exit status 0 before it answered" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_step_whose_loss_is_nan_fails_every_engine_and_the_notebook_reads_failed(tmp_path, capsys):
    import json

    from benchlib.records import load_run_info
    from benchlib.runner.cli import main

    path = _write(tmp_path, "nan.py", HEAD + "def loss(model, x):\n    return model(x).sum() * float('nan')\n")
    assert main(["run", path, "--quick", "-p", "trials=1", "-p", "engines=torch,torch.func", "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 1
    (run,) = (tmp_path / "out").iterdir()
    entry = load_run_info(run)["notebooks"]["nan"]
    assert entry["status"] == "failed"  # every case failed: nothing measured is not a partial answer
    assert "the gradient holds NaN or inf (in weight, bias)" in json.dumps(entry)


RUN_IMPORTS = """
import json, sys
from benchlib.runner.cli import main

code = main(["run", sys.argv[1], "--quick", "-p", "engines=torch", "-p", "trials=1", "--out", sys.argv[2],
             "--no-progress"])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


@pytest.mark.slow  # a fresh interpreter: this one has imported torch for other tests
def test_benchlib_run_plans_and_records_its_environment_without_importing_torch(tmp_path):
    """`benchlib run FILE` only plans and starts processes: torch is imported by the child that reads the file, the
    kernel and the cases, never by the command itself (2-3 s a run); run.json's torch facts are the reader's."""
    import json
    import subprocess
    import sys

    path = _write(tmp_path, "fine.py", GOOD)
    done = subprocess.run([sys.executable, "-c", RUN_IMPORTS, path, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=600)
    said = json.loads(done.stdout.splitlines()[-1])
    assert said == {"code": 0, "torch": False}, done.stderr[-2000:]
    (run,) = (tmp_path / "out").iterdir()
    environment = json.loads((run / "run.json").read_text())["environment"]
    assert environment["torch_threads"] >= 1 and environment["gpu"]["available"] in (True, False)


@pytest.mark.slow
def test_what_a_process_holds_is_measured_in_the_reading_child_not_inherited_from_a_large_parent(tmp_path):
    """Linux folds a parent's resident high-water mark into its child's ru_maxrss at exec: a reader started from a
    kernel or worker holding a gigabyte would claim every rank, and torch alone, needs that much."""
    from benchlib.usermodel.reading import read_in_child

    held = bytearray(1 << 30)
    held[::4096] = b"\1" * len(held[::4096])  # resident here, in the parent, before the child starts
    ((facts,),) = read_in_child([[_write(tmp_path, "fine.py", GOOD)]])
    assert 0 < facts.interpreter_bytes <= facts.resident_bytes < len(held)
    del held
