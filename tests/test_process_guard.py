"""The `slow` mark can be trusted: a test that starts a process without it fails, naming the process and the fix
(tests/conftest.py), so `make check` (the tests not marked slow) starts none."""

import shutil
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

STARTS_PROCESSES = """
import multiprocessing
import os
import subprocess

import pytest


def test_unmarked_subprocess():
    subprocess.run(["true"], check=True)


def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_unmarked_multiprocessing():
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()


@pytest.mark.slow
def test_marked_subprocess():
    subprocess.run(["true"], check=True)


def test_no_process():
    assert sum(range(4)) == 6
"""


@pytest.mark.slow  # the inner tests start processes inside this one
def test_a_process_started_by_a_test_not_marked_slow_fails_it_by_name(pytester):
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts a process\n")
    pytester.makepyfile(test_starts=STARTS_PROCESSES)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=3)
    result.stdout.fnmatch_lines(["*test_unmarked_subprocess started 1 process(es) but is not marked slow: mark it "
                                 "@pytest.mark.slow*", "*fork_exec: true*"])
    result.stdout.fnmatch_lines(["*test_unmarked_fork started 1 process(es)*", "*fork: (a copy of this process)*"])
    result.stdout.fnmatch_lines(["*test_unmarked_multiprocessing started*"])
    assert "test_marked_subprocess" not in "\n".join(line for line in result.outlines if "FAILED" in line)
