"""Batch runs of declared benchmarks through papermill into results/<run-id>/, and the `benchlib` command."""

from benchlib.runner.execute import RunOptions, run
from benchlib.runner.notebooks import NotebookSpec, RunnerError, inspect, select_notebooks
from benchlib.runner.outcomes import NotebookResult, RunResult
from benchlib.runner.preflight import plan

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
