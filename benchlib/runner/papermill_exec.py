"""One notebook through papermill: the kernel it runs in and how its failure is told.

Shared by the local run loop (`benchlib.runner.execute`) and a grid point on a Dask worker
(`benchlib.runner.sweep`), so the two execute a notebook the same way. It sits below both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import papermill

from benchlib.runner.kernels import kernel_environment

KERNEL_NAME = "python3"


class _CheckedByDeclaration(logging.Filter):
    """papermill warns about every injected name its parameters cell does not assign. A notebook's
    cell holds overrides only; the runner has checked every name against the benchmark's
    declaration, so that warning would be noise on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Passed unknown parameter")


logging.getLogger("papermill").addFilter(_CheckedByDeclaration())


def error_text(error: BaseException) -> str:
    """papermill's execution error as 'ename: evalue' (the notebook's own exception); others by type."""
    ename = getattr(error, "ename", None)
    if ename:
        return f"{ename}: {getattr(error, 'evalue', '')}"
    return f"{type(error).__name__}: {error}"


def execute_notebook(source: Path | str, output: Path | str, parameters: Mapping[str, Any], *, cwd: Path | str,
                     kernel_manager_class: type, figures_env: Mapping[str, str],
                     stdout_file: TextIO | None = None, stderr_file: TextIO | None = None) -> str | None:
    """Execute `source` into `output` in the `KERNEL_NAME` kernel, with `figures_env` in the kernel's
    environment. Returns None when it ran to the end, else the error as `error_text` tells it; a
    KeyboardInterrupt (Ctrl-C, or a signal turned into one) is not a failure and propagates."""
    try:
        with kernel_environment(figures_env):
            papermill.execute_notebook(
                str(source), str(output), parameters=dict(parameters), kernel_name=KERNEL_NAME,
                progress_bar=False, stdout_file=stdout_file, stderr_file=stderr_file, cwd=str(cwd),
                kernel_manager_class=kernel_manager_class)
    except Exception as failure:  # a notebook's failure is a result to record, not to raise
        return error_text(failure)
    return None
