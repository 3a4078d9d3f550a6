"""Batch runs of declared benchmarks through papermill into results/<run-id>/, and the `benchlib` command."""

from __future__ import annotations

import importlib

# Public names and the module that holds each, imported when first asked for: the `benchlib` command
# refuses a bad name or file before papermill, pandas or torch is imported.
_HOMES = {
    "NotebookResult": "outcomes",
    "NotebookSpec": "notebooks",
    "RunOptions": "execute",
    "RunResult": "outcomes",
    "RunnerError": "notebooks",
    "inspect": "notebooks",
    "plan": "preflight",
    "run": "execute",
    "select_notebooks": "notebooks",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_HOMES)
