"""Memory over time: a daemon thread samples the device's memory, tagged with phase marks.

On CPU a sample is one pread of /proc/self/statm (RSS); on CUDA it is
`torch.cuda.memory_allocated`, a host-side counter that needs no synchronization. The sampler
needs the GIL for each sample, so pure-Python code under it is interrupted at most every
`sys.getswitchinterval()` (5 ms by default); calibration measures the resulting overhead.
"""
from __future__ import annotations

import threading
from time import perf_counter

from .devices import Device, resolve_device

_active: list["MemoryTimeline"] = []
_active_lock = threading.Lock()


def mark(phase: str) -> None:
    """Mark `phase` on every active timeline (no-op when none is active)."""
    for timeline in list(_active):
        timeline.mark(phase)


class MemoryTimeline:
    """Context manager; `.frame()` gives `t_s, bytes, phase` with bytes above the level at entry."""

    def __init__(self, device: str | Device = "cpu", interval_s: float = 0.002, phase: str = ""):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        self.device = resolve_device(device)
        self.interval_s = float(interval_s)
        self.baseline_bytes: int | None = None
        self.marks: list[tuple[float, str]] = []
        self._phase = phase
        self._samples: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        phase = self._phase
        self._samples.append((perf_counter() - self._t0, self.device.memory_in_use(), phase))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def mark(self, phase: str) -> None:
        """Start a named phase now; a sample is taken at the mark so short phases still show."""
        self._phase = str(phase)
        self.marks.append((perf_counter() - self._t0, self._phase))
        self._sample()

    def __enter__(self) -> "MemoryTimeline":
        if self._thread is not None:
            raise RuntimeError("this MemoryTimeline was already started; create a new one")
        self._t0 = perf_counter()
        self.baseline_bytes = self.device.memory_in_use()
        self._samples.append((0.0, self.baseline_bytes, self._phase))
        self._thread = threading.Thread(target=self._run, name="benchlib-memory-timeline",
                                        daemon=True)
        self._thread.start()
        with _active_lock:
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _active_lock:
            if self in _active:
                _active.remove(self)
        self._stop.set()
        self._thread.join()
        self._sample()

    def frame(self):
        """Samples as a DataFrame: t_s (since entry), bytes (above the entry level), phase."""
        import pandas as pd

        samples = sorted(self._samples)
        baseline = self.baseline_bytes or 0
        return pd.DataFrame({
            "t_s": pd.Series([s[0] for s in samples], dtype="float64"),
            "bytes": pd.Series([s[1] - baseline for s in samples], dtype="int64"),
            "phase": pd.Series([s[2] for s in samples], dtype="object"),
        })
