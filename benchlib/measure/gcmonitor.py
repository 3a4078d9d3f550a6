"""GC pauses, from the interpreter's own `gc.callbacks` (start/stop of every collection)."""
from __future__ import annotations

import gc
from time import perf_counter
from typing import NamedTuple


class GCPause(NamedTuple):
    """One collection. `collected` and `uncollectable` are the interpreter's own counts (the `stop`
    callback's info); `tracked_before` is how many objects the collection had to walk (the tracked
    objects of its generation and the younger ones), -1 when not counted; `count_s` is the time
    that count took, spent just before `start_s`: not part of the pause (nor, in `measure_steps`,
    of the step)."""

    start_s: float
    duration_s: float
    generation: int
    collected: int
    uncollectable: int
    tracked_before: int = -1
    count_s: float = 0.0


def tracked_objects(generation: int = 2) -> int:
    """Objects the collector tracks in `generation` and the younger ones: what a collection of that
    generation walks (frozen objects are in none of them)."""
    return sum(len(gc.get_objects(g)) for g in range(generation + 1))


class GCMonitor:
    """Context manager recording every collection while active, as `GCPause`s (`.pauses`, with
    `start_s` relative to entry).

    With `count_tracked`, each collection's `tracked_before` is counted in the start callback. The
    count lists every object of the collected generations, a fraction of what the collection itself
    costs, so it is timed and kept out of the pause; `measure_steps` takes it out of the step too. Each monitor registers its own callback, so several can be active at once
    (nested or overlapping); the callback is removed on exit even when the body raises.
    """

    def __init__(self, count_tracked: bool = False):
        self.count_tracked = count_tracked
        self.pauses: list[GCPause] = []
        self._t0 = 0.0
        self._started: float | None = None
        self._counted: tuple[int, float] = (-1, 0.0)
        self._callback = None

    def _on_gc(self, phase: str, info: dict) -> None:
        now = perf_counter()
        if phase == "start":
            if self.count_tracked:
                tracked = tracked_objects(int(info["generation"]))
                self._counted = (tracked, perf_counter() - now)
                now = perf_counter()
            self._started = now
        elif self._started is not None:
            self.pauses.append(GCPause(self._started - self._t0, now - self._started, int(info["generation"]),
                                       int(info["collected"]), int(info["uncollectable"]), *self._counted))
            self._started, self._counted = None, (-1, 0.0)

    def __enter__(self) -> "GCMonitor":
        if self._callback is not None:
            raise RuntimeError("this GCMonitor is already active; use a second GCMonitor instead")
        self._t0 = perf_counter()
        self._callback = self._on_gc
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        try:
            gc.callbacks.remove(self._callback)
        except ValueError:
            pass  # someone cleared gc.callbacks; nothing left to remove
        self._callback = None
        self._started = None

    @property
    def count(self) -> int:
        return len(self.pauses)

    @property
    def seconds(self) -> float:
        return sum(pause.duration_s for pause in self.pauses)
