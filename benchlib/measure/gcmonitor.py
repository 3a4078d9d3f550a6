"""GC pauses, from the interpreter's own `gc.callbacks` (start/stop of every collection)."""
from __future__ import annotations

import gc
from time import perf_counter


class GCMonitor:
    """Context manager recording every collection while active.

    `.pauses` holds `(start_s, duration_s, generation)` with `start_s` relative to entry.
    Each monitor registers its own callback, so several can be active at once (nested or
    overlapping); the callback is removed on exit even when the body raises.
    """

    def __init__(self):
        self.pauses: list[tuple[float, float, int]] = []
        self._t0 = 0.0
        self._started: float | None = None
        self._callback = None

    def _on_gc(self, phase: str, info: dict) -> None:
        now = perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self.pauses.append((self._started - self._t0, now - self._started,
                                int(info["generation"])))
            self._started = None

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
        return sum(duration for _, duration, _ in self.pauses)
