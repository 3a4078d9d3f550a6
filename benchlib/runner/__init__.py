"""Batch runs of declared benchmarks through papermill into results/<run-id>/, and the `benchlib` command."""

from benchlib.runner.execute import NotebookResult, RunOptions, RunResult, plan, run
from benchlib.runner.notebooks import NotebookSpec, RunnerError, inspect, select_notebooks

__all__ = [
    "NotebookResult",
    "NotebookSpec",
    "RunOptions",
    "RunResult",
    "RunnerError",
    "inspect",
    "plan",
    "run",
    "select_notebooks",
]
