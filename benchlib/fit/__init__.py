"""`benchlib fit`: what fits a memory limit. The largest value of a parameter under each engine and combination
(`largest`), or which engines fit the value a user has (`at`); measured in fresh processes and confirmed where this
machine holds the limit, predicted with an interval where it cannot (`predicted`: CUDA without a GPU).

The rooms, each one job: `asking` (the question, checked before any work), `search` (the one search loop, and
the largest value under a limit), `sizing` (size models), `tracing` (a step's bytes under fake tensors), `measured`
(fresh processes, the march toward the answer, confirmation), `plan` (a measured fit's phases, in order),
`predicted` (CUDA through an allocator model), `result` (the answers, lines and records), `pace` (progress),
`in_child` (every call of the user's code, each in a process of its own), `advice` (which blocks to checkpoint
where eager does not fit), `settings` (how hard the measured search works: `THOROUGH`, or `QUICK` for a first
look). The answer's table for report.html is `benchlib.report.tables.fit`.
"""

from __future__ import annotations

from benchlib.lazy_exports import lazy_exports

_HOMES = {
    "FitError": "asking",
    "FitInterrupted": "asking",
    "MemoryLimit": "asking",
    "fit": "largest",
    "fit_at": "at",
    "FitResult": "result",
    "AtResult": "at",
    "Search": "settings",
    "THOROUGH": "settings",
    "QUICK": "settings",
}

__getattr__ = lazy_exports(__name__, _HOMES)

__all__ = sorted(_HOMES)
