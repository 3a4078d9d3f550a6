"""Allocation counts and bytes: memray on CPU, the CUDA caching allocator's stats on CUDA.

On CPU memray intercepts the system allocator (malloc, calloc, realloc, the aligned variants
and mmap): NumPy and torch CPU buffers, CPython's large objects and arenas. With Python-allocator
tracing (the default) it also sees every object CPython's allocator hands out, including the
small ones pymalloc serves from its arenas without calling malloc (tape nodes, closures, tuples,
tensor wrappers), which Julia's `@time` would count; those are the `python_*` counts. The two
overlap (a Python object over 512 bytes is also a malloc call), so they are reported side by
side, never summed. Tracing slows the traced code, so `measure` runs it in a pass of its own,
apart from the timed repeats.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Callable

from .devices import Device, cuda_stat, resolve_device

SOURCE_MEMRAY = "memray"
SOURCE_CUDA = "cuda-caching-allocator"
_ALLOCATING = ("MALLOC", "CALLOC", "REALLOC", "POSIX_MEMALIGN", "ALIGNED_ALLOC", "MEMALIGN",
               "VALLOC", "PVALLOC", "MMAP")
_PYTHON_ALLOCATING = ("PYMALLOC_MALLOC", "PYMALLOC_CALLOC", "PYMALLOC_REALLOC")


class AllocationTrackingUnavailable(RuntimeError):
    """Allocation tracking cannot run here (memray missing, or another tracker is active)."""


@dataclass(frozen=True)
class Allocations:
    """System-allocator calls and bytes; Python-allocator allocations and bytes when traced (CPU)."""

    count: int
    bytes: int
    source: str
    python_count: int | None = None
    python_bytes: int | None = None


def memray_available() -> bool:
    try:
        import memray  # noqa: F401
    except ImportError:
        return False
    return True


class AllocationTracker:
    """Context manager counting allocations made inside it; the result is in `.allocations`.
    `python_allocators=False` skips the Python-allocator tracing (faster; no `python_*` counts)."""

    def __init__(self, device: str | Device = "cpu", python_allocators: bool = True):
        self.device = resolve_device(device)
        self.python_allocators = bool(python_allocators)
        self.allocations: Allocations | None = None
        self._tracker = None
        self._tmpdir = None
        self._path = ""
        self._stats_before = None

    def __enter__(self) -> "AllocationTracker":
        if self.device.is_cuda:
            self.device.synchronize()
            self._stats_before = _cuda_counters(self.device)
            return self
        try:
            import memray
        except ImportError as err:
            raise AllocationTrackingUnavailable(
                "counting CPU allocations needs memray (Linux/macOS only): pip install memray"
            ) from err
        self._tmpdir = tempfile.TemporaryDirectory(prefix="benchlib-memray-")
        self._path = os.path.join(self._tmpdir.name, "allocations.bin")
        self._tracker = memray.Tracker(self._path, native_traces=False,
                                       trace_python_allocators=self.python_allocators)
        try:
            self._tracker.__enter__()
        except RuntimeError as err:
            self._tmpdir.cleanup()
            raise AllocationTrackingUnavailable(
                f"memray could not start ({err}); usually a memray Tracker is already active in "
                "this process (memray cannot nest): stop it, or run without allocation "
                "tracking (track_allocations=False)"
            ) from err
        return self

    def __exit__(self, *exc) -> None:
        if self.device.is_cuda:
            self.device.synchronize()
            count0, bytes0 = self._stats_before
            count1, bytes1 = _cuda_counters(self.device)
            self.allocations = Allocations(count1 - count0, bytes1 - bytes0, SOURCE_CUDA)
            return
        try:
            self._tracker.__exit__(*exc)
            if exc[0] is None:
                self.allocations = _read_memray(self._path, self.python_allocators)
        finally:
            self._tmpdir.cleanup()


def _cuda_counters(device: Device) -> tuple[int, int]:
    """Allocations and bytes handed out so far (memory_stats' allocation.all.allocated and
    allocated_bytes.all.allocated)."""
    return (cuda_stat(device.index, "allocation", "allocated"),
            cuda_stat(device.index, "allocated_bytes", "allocated"))


def _read_memray(path: str, python_allocators: bool) -> Allocations:
    """Sum the allocating records, system and Python apart, leaving out those memray makes while
    it starts and stops (their innermost Python frame is AllocationTracker.__enter__ or __exit__)."""
    import memray

    allocating = {getattr(memray.AllocatorType, name) for name in _ALLOCATING}
    python = {getattr(memray.AllocatorType, name) for name in _PYTHON_ALLOCATING}
    tracker_code = {AllocationTracker.__enter__.__code__, AllocationTracker.__exit__.__code__}
    tracker_frames = {(code.co_name, code.co_filename) for code in tracker_code}
    own_by_stack: dict[int, bool] = {}
    count = nbytes = python_count = python_bytes = 0
    for record in memray.FileReader(path).get_allocation_records():
        is_python = record.allocator in python
        if not is_python and record.allocator not in allocating:
            continue
        own = own_by_stack.get(record.stack_id)
        if own is None:
            frames = record.stack_trace(max_stacks=1)
            own = bool(frames) and frames[0][:2] in tracker_frames
            own_by_stack[record.stack_id] = own
        if own:
            continue
        if is_python:
            python_count += record.n_allocations
            python_bytes += record.size * record.n_allocations
        else:
            count += record.n_allocations
            nbytes += record.size * record.n_allocations
    if not python_allocators:
        return Allocations(count, nbytes, SOURCE_MEMRAY)
    return Allocations(count, nbytes, SOURCE_MEMRAY, python_count, python_bytes)


def count_allocations(fn: Callable[[], object], device: str | Device = "cpu",
                      python_allocators: bool = True) -> Allocations:
    """Call `fn` once under the device's allocation tracker; its result is discarded."""
    with AllocationTracker(device, python_allocators) as tracker:
        fn()
    return tracker.allocations
