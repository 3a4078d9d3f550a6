"""Every error a command ends with carries its exit status (docs/setup.md, "Exit status"): a refusal 2, work that
could not finish 1, an interruption 130; an error benchlib does not explain is a bug, "internal error", with its
traceback saved to a file the line names, never printed as a refusal."""

import tempfile

import pytest

from benchlib.analysis.history import HistoryError
from benchlib.benchmark import DeclarationError, ParameterError
from benchlib.engines.techniques.base import CombinationError
from benchlib.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REFUSED, Failed, Refused
from benchlib.fit.asking import FitError
from benchlib.fit.in_child import ChildFailed
from benchlib.measure.isolation import CaseFailed
from benchlib.records.places import OutDirRefused
from benchlib.records.store import RecordsUnreadable
from benchlib.runner import cli
from benchlib.runner.arguments import RunnerError
from benchlib.usermodel.gate import GateError
from benchlib.usermodel.loader import ModelFileError, UserCodeError


def _failing_command(monkeypatch, error: BaseException) -> None:
    """`benchlib runs` raising `error`, as any command's handler might."""
    real = cli._parser

    def parser():
        made = real()
        runs = made._subparsers._group_actions[0].choices["runs"]

        def handler(arguments):
            raise error

        runs.set_defaults(handler=handler)
        return made

    monkeypatch.setattr(cli, "_parser", parser)


@pytest.mark.parametrize("kind", [ParameterError, DeclarationError, CombinationError, FitError, ModelFileError,
                                  RunnerError, HistoryError, GateError, OutDirRefused, RecordsUnreadable])
def test_every_refusal_is_a_value_error_that_ends_with_2_and_its_own_message(kind, monkeypatch, capsys):
    assert issubclass(kind, (Refused, ValueError))
    _failing_command(monkeypatch, kind("x=3 is refused; valid: 1 or 2"))
    assert cli.main(["runs"]) == EXIT_REFUSED
    assert capsys.readouterr().err == "benchlib: error: x=3 is refused; valid: 1 or 2\n"


@pytest.mark.parametrize("kind", [Failed, ChildFailed, UserCodeError])
def test_work_that_could_not_finish_ends_with_1_and_its_own_message(kind, monkeypatch, capsys):
    _failing_command(monkeypatch, kind("the child was killed by SIGKILL"))
    assert cli.main(["runs"]) == EXIT_FAILED
    assert capsys.readouterr().err == "benchlib: error: the child was killed by SIGKILL\n"


def test_a_failed_case_is_one_line_and_its_childs_traceback_is_for_debug(monkeypatch, capsys):
    failed = CaseFailed("mlp/torch", "exited with status 1", child_traceback="Traceback ...\nZeroDivisionError: x\n")
    _failing_command(monkeypatch, failed)
    assert cli.main(["runs"]) == EXIT_FAILED
    assert capsys.readouterr().err == ("benchlib: error: case 'mlp/torch' failed: exited with status 1 (--debug shows "
                                       "the child's traceback)\n")
    assert cli.main(["runs", "--debug"]) == EXIT_FAILED
    assert "--- in the child process ---\nTraceback ...\nZeroDivisionError: x" in capsys.readouterr().err


def _a_lookup_that_fails():
    return {}["engine"]


def _a_parse_that_fails():
    return int("3 GB")  # Python's own ValueError: not a refusal benchlib wrote


@pytest.mark.parametrize("buggy", [_a_lookup_that_fails, _a_parse_that_fails])
def test_a_bug_is_an_internal_error_with_its_traceback_saved_never_a_refusal(buggy, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        buggy()
    except Exception as raised:  # noqa: BLE001 - the bug, with its traceback
        error = raised
    _failing_command(monkeypatch, error)
    assert cli.main(["runs", "--out", str(tmp_path)]) == EXIT_FAILED
    line = capsys.readouterr().err
    assert line.startswith(f"benchlib: internal error: {type(error).__name__}: ") and "a bug in benchlib" in line
    (saved,) = tmp_path.glob("benchlib-internal-error-*.txt")
    assert f"its traceback is in {saved}; please attach it to a report" in line
    text = saved.read_text()
    assert text.startswith(f"benchlib runs --out {tmp_path}\nTraceback (most recent call last)")
    assert f"in {buggy.__name__}" in text  # where it was raised, for the report


def test_an_interruption_ends_with_130(monkeypatch, capsys):
    _failing_command(monkeypatch, KeyboardInterrupt())
    assert cli.main(["runs"]) == EXIT_INTERRUPTED
    assert "interrupted; everything written so far is kept" in capsys.readouterr().err
