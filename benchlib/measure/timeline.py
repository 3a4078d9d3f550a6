"""Memory over time: a daemon thread samples the device's memory, tagged with phase marks.

On CPU a sample is one pread of /proc/self/statm (RSS); on CUDA it is
`torch.cuda.memory_allocated`, a host-side counter that needs no synchronization. The sampler
needs the GIL for each sample, so pure-Python code under it is interrupted at most every
`sys.getswitchinterval()` (5 ms by default); calibration measures the resulting overhead.
"""
from __future__ import annotations

import threading
from array import array
from time import perf_counter

from .devices import Device, resolve_device

_active: list["MemoryTimeline"] = []
_active_lock = threading.Lock()


def mark(phase: str) -> None:
    """Mark `phase` on every active timeline (no-op when none is active)."""
    for timeline in list(_active):
        timeline.mark(phase)


class MemoryTimeline:
    """Context manager; `.frame()` gives `t_s, bytes, phase` with bytes above the level at entry.

    Samples go into typed arrays, not a list of tuples: a tuple per sample would outlive the
    sample and count towards the collector's generation-0 threshold, so the sampler itself would
    trigger GC pauses that `measure` then attributes to the measured code (and would hold about
    130 bytes per sample in the peak instead of 18).
    """

    def __init__(self, device: str | Device = "cpu", interval_s: float = 0.002, phase: str = ""):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        self.device = resolve_device(device)
        self.interval_s = float(interval_s)
        self.baseline_bytes: int | None = None
        self._phases: list[str] = [str(phase)]  # phase names; samples and marks hold indices
        self._phase_index = {self._phases[0]: 0}
        self._phase = 0
        self._t = array("d")
        self._bytes = array("q")
        self._sample_phase = array("l")
        self._mark_t = array("d")
        self._mark_phase = array("l")
        # The sampler thread and `mark` both append to three arrays that must stay aligned.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        with self._lock:
            self._append_sample()

    def _append_sample(self) -> None:
        self._t.append(perf_counter() - self._t0)
        self._bytes.append(self.device.memory_in_use())
        self._sample_phase.append(self._phase)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def mark(self, phase: str) -> None:
        """Start a named phase now; a sample is taken at the mark so short phases still show."""
        phase = str(phase)
        with self._lock:
            index = self._phase_index.get(phase)
            if index is None:
                index = self._phase_index[phase] = len(self._phases)
                self._phases.append(phase)
            self._phase = index
            self._mark_t.append(perf_counter() - self._t0)
            self._mark_phase.append(index)
            self._append_sample()

    @property
    def marks(self) -> list[tuple[float, str]]:
        """`(t_s, phase)` of every mark, in order."""
        return [(t, self._phases[i]) for t, i in zip(self._mark_t, self._mark_phase)]

    def __enter__(self) -> "MemoryTimeline":
        if self._thread is not None:
            raise RuntimeError("this MemoryTimeline was already started; create a new one")
        self._t0 = perf_counter()
        self.baseline_bytes = self.device.memory_in_use()
        self._t.append(0.0)
        self._bytes.append(self.baseline_bytes)
        self._sample_phase.append(self._phase)
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
        import numpy as np
        import pandas as pd

        with self._lock:
            t = np.array(self._t, dtype="float64")
            nbytes = np.array(self._bytes, dtype="int64")
            phase = [self._phases[i] for i in self._sample_phase]
        return pd.DataFrame({
            "t_s": pd.Series(t, dtype="float64"),
            "bytes": pd.Series(nbytes - (self.baseline_bytes or 0), dtype="int64"),
            "phase": pd.Series(phase, dtype="object"),
        })
