"""Batch runs of the notebooks through papermill into results/<run-id>/, and the `benchlib` command."""

from benchlib.runner.execute import NotebookResult, RunResult, plan, run
from benchlib.runner.notebooks import NotebookSpec, Parameter, RunnerError, inspect, parse_value, select_notebooks

__all__ = [
    "NotebookResult",
    "NotebookSpec",
    "Parameter",
    "RunResult",
    "RunnerError",
    "inspect",
    "parse_value",
    "plan",
    "run",
    "select_notebooks",
]
