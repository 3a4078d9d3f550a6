"""Memory over time: a daemon thread samples the device's memory, tagged with phase marks.

On CPU a sample is one pread of /proc/self/statm (RSS); on CUDA it is
`torch.cuda.memory_allocated`, a host-side counter that needs no synchronization. A `gauge`
(a callable returning {role: bytes}, e.g. the live counters of an engine's tape) is read at the
same instants, so what an engine says it holds and what the allocator holds share one clock. The sampler
needs the GIL for each sample, so pure-Python code under it is interrupted at most every
`sys.getswitchinterval()` (5 ms by default); calibration measures the resulting overhead.
"""
from __future__ import annotations

import threading
from array import array
from time import perf_counter
from typing import Callable, Mapping

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

    def __init__(self, device: str | Device = "cpu", interval_s: float = 0.002, phase: str = "",
                 gauge: Callable[[], Mapping[str, int]] | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        if gauge is not None and not callable(gauge):
            raise TypeError(f"gauge must be a callable returning {{role: bytes}} or None, got {gauge!r}")
        self.device = resolve_device(device)
        self.interval_s = float(interval_s)
        self.baseline_bytes: int | None = None
        self._phases: list[str] = [str(phase)]  # phase names; samples and marks hold indices
        self._phase_index = {self._phases[0]: 0}
        self._phase = 0
        self._t = array("d")
        self._bytes = array("q")
        self._sample_phase = array("l")
        self._gauge = gauge
        self._roles: dict[str, array] = {}  # role -> bytes at each sample
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
        if self._gauge is not None:
            for role, nbytes in self._gauge().items():
                column = self._roles.get(role)
                if column is None:  # a role first reported now was 0 at every earlier sample
                    if role in ("t_s", "bytes", "phase"):
                        raise ValueError(f"a gauge's role cannot be named {role!r}: that column is the timeline's own")
                    column = self._roles[role] = array("q", bytes(8 * (len(self._t) - 1)))
                column.append(int(nbytes))

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
        with self._lock:  # the entry sample: t = 0 and the baseline, by definition
            self._append_sample()
            self._t[-1] = 0.0
            self._bytes[-1] = self.baseline_bytes
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
        """Samples as a DataFrame: t_s (since entry), bytes (above the entry level), phase, and
        one column of bytes per role the gauge reported (absolute: a gauge counts from zero)."""
        import numpy as np
        import pandas as pd

        with self._lock:
            t = np.array(self._t, dtype="float64")
            nbytes = np.array(self._bytes, dtype="int64")
            phase = [self._phases[i] for i in self._sample_phase]
            roles = {role: np.array(column, dtype="int64") for role, column in self._roles.items()}
        return pd.DataFrame({
            "t_s": pd.Series(t, dtype="float64"),
            "bytes": pd.Series(nbytes - (self.baseline_bytes or 0), dtype="int64"),
            "phase": pd.Series(phase, dtype="object"),
            **{role: pd.Series(values, dtype="int64") for role, values in roles.items()},
        })


def timeline_to_json(frame) -> dict:
    """A timeline frame as column lists (JSON crosses the isolation boundary, never pickle)."""
    return {column: ([str(v) for v in frame[column]] if column == "phase" else
                     [float(v) for v in frame[column]] if column == "t_s" else [int(v) for v in frame[column]])
            for column in frame.columns}


def timeline_from_json(columns: dict):
    """The frame `timeline_to_json` wrote: t_s float, phase text, bytes and every role integer."""
    import pandas as pd

    dtypes = {"t_s": "float64", "phase": "object"}
    return pd.DataFrame({column: pd.Series(values, dtype=dtypes.get(column, "int64"))
                         for column, values in columns.items()})
