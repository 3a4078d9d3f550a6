"""Files a careless user or CI job leaves behind: run.json that is JSON but not an object, an output
path that names a run's own data, a model file whose name is not ASCII. Each is refused or listed,
saying which file, and no run's file is changed."""

import json

import pytest

from benchlib.records.store import RecordsUnreadable, list_runs, load_run_info
from benchlib.runner.cli import main


def _run(root, name, info):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(info if isinstance(info, str) else json.dumps(info))
    return folder


@pytest.mark.parametrize("text", ["[1, 2, 3]", "null", "\"a string\"", "7"])
def test_a_run_json_that_is_not_an_object_is_named_and_the_good_runs_are_still_listed(tmp_path, text):
    bad = _run(tmp_path, "bad", text)
    _run(tmp_path, "good", {"run_id": "good", "started_at": "2026-01-01T00:00:00", "ended_at": "2026-01-01T00:01:00",
                            "notebooks": {}, "environment": {}})
    with pytest.raises(RecordsUnreadable, match="run.json holds a JSON .*, not an object"):
        load_run_info(bad)
    runs = list_runs(tmp_path).set_index("path")
    assert "not an object" in runs.loc[str(bad), "problem"] and runs.loc[str(tmp_path / "good"), "problem"] == ""
    assert main(["runs", "--out", str(tmp_path)]) == 1  # listed, with its problem: exit 1, not a crash


def test_history_never_writes_its_page_over_a_runs_files(tmp_path, capsys):
    run = _run(tmp_path, "r1", {"run_id": "r1"})
    before = (run / "run.json").read_bytes()
    for target in (run / "run.json", run):
        assert main(["history", "--out", str(tmp_path), "--html", str(target)]) == 2
        assert (run / "run.json").read_bytes() == before
    error = capsys.readouterr().err
    assert "is a file of the run" in error and "is a directory" in error


def test_a_model_file_with_a_non_ascii_stem_gets_an_ascii_name_and_a_non_ascii_name_is_refused(tmp_path):
    from benchlib.usermodel import ModelFileError, read_model_file

    body = ("import torch\n\ndef model():\n    return torch.nn.Linear(2, 1)\n\ndef batch():\n    return torch.randn(3, 2)"
            "\n\ndef loss(model, x):\n    return model(x).sum()\n")
    path = tmp_path / "mödel ✓.py"
    path.write_text(body)
    assert read_model_file(path).name == "m_del__"
    path.write_text('NAME = "mödel"\n' + body)
    with pytest.raises(ModelFileError, match="NAME must be an ASCII identifier"):
        read_model_file(path)


@pytest.mark.slow
def test_a_reader_that_leaves_early_does_not_change_the_exit_status():
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "benchlib.runner.cli", "list"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # gone before the first line: every write meets a closed pipe
    _, error = process.communicate(timeout=120)
    assert process.returncode == 0, error.decode()
    assert b"Broken pipe" not in error and b"Exception ignored" not in error


@pytest.mark.parametrize("value", ["inf", "nan", "0", "1e12"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused_before_anything_runs(tmp_path, value, capsys):
    assert main(["run", "dot_chain", "--quick", "--timeout", value, "--out", str(tmp_path / "out")]) == 2
    assert "--timeout must be a number of seconds > 0, got" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_json_without_its_facts_or_looping_on_itself_is_listed_with_its_problem(tmp_path):
    _run(tmp_path, "bare", {"ended_at": "2026-01-01T00:01:00"})
    looping = tmp_path / "loop"
    looping.mkdir()
    (looping / "run.json").symlink_to(looping / "run.json")
    runs = list_runs(tmp_path).set_index("path")
    bare = runs.loc[str(tmp_path / "bare")]
    assert bare["state"] == "incomplete" and "run.json lacks run_id, started_at, environment, notebooks" in bare["problem"]
    assert "run.json is a link that leads nowhere" in runs.loc[str(looping), "problem"]


@pytest.mark.slow
def test_a_model_file_whose_name_is_not_utf8_is_refused_before_any_work_naming_its_bytes(tmp_path, capsys):
    import os

    from benchlib.usermodel.template import TEMPLATE

    model_file = tmp_path / os.fsdecode(b"m\xffodel.py")  # a name Linux allows and no text can carry
    model_file.write_text(TEMPLATE)
    assert main(["run", str(model_file), "--quick", "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "m\\xffodel.py: the file name is not valid UTF-8" in error and "codec" not in error
    assert not (tmp_path / "out").exists()
