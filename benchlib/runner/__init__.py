"""Batch runs of declared benchmarks through papermill into results/<run-id>/, and the `benchlib` command."""

from __future__ import annotations

from benchlib.lazy_exports import lazy_exports

# Public names and the module that holds each, imported when first asked for: the `benchlib` command
# refuses a bad name or file before papermill, pandas or torch is imported.
_HOMES = {
    "NotebookResult": "outcomes",
    "NotebookSpec": "notebooks",
    "RunOptions": "execute",
    "RunResult": "outcomes",
    "RunnerError": "arguments",
    "inspect": "notebooks",
    "values_for": "preflight",
    "run": "execute",
    "select_notebooks": "notebooks",
}

__getattr__ = lazy_exports(__name__, _HOMES)


__all__ = sorted(_HOMES)
