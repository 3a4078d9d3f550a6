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

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from time import perf_counter
from typing import Callable

from benchlib.source_files import is_library, short_path
from benchlib.units import format_bytes

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
    peak_bytes: int | None = None  # tracked peak: most bytes live at once inside the tracker
    sites: tuple["PeakSite", ...] | None = None  # the allocations live at that peak, by line (with `sites`)
    floor_count: int | None = None  # the tracker's floor, already subtracted from `count` (memray)
    floor_python_count: int | None = None  # the same for `python_count`


@dataclass(frozen=True)
class PeakSite:
    """Bytes live at the tracked peak that one line allocated: the innermost frame outside Python's
    installation and benchlib (the user's line), or the innermost frame when there is none."""

    file: str
    line: int
    function: str
    bytes: int
    count: int
    share: float  # of the tracked peak (of all temporary or allocated bytes, for those kinds of site)
    inner: str = ""  # the innermost frame of the site's largest record where it is not the site itself ("torch/nn/functional.py:2380 in linear")

    def __str__(self) -> str:
        return f"{self.where}:{self.line} in {self.function} ({format_bytes(self.bytes)}, " \
               f"{100 * self.share:.0f}% of the peak)"

    @property
    def where(self) -> str:
        """The file as a reader finds it (`source_files.short_path`)."""
        return short_path(self.file)


SITES_KEPT = 10  # the largest sites at the peak; the rest are summed in no row
ATTRIBUTION_KEPT = 200  # the largest sites of each kind an attribution pass keeps (records keep fewer: diffs see these)
TEMPORARY_THRESHOLD = 1  # memray's: an allocation freed before this many other allocations were made is temporary
SITE_KINDS = ("peak", "temporary", "allocated")
NATIVE = "<native>"  # the site of records with no Python frame on their stack

def memray_available() -> bool:
    try:
        import memray  # noqa: F401
    except ImportError:
        return False
    return True


def _empty() -> None:
    """The floor's call: a Python function that does nothing."""


def _in_call(fn: Callable[[], object]) -> None:
    """The call's scope: a record made under this frame was made by the call (fn's result is dropped here)."""
    fn()


def _floor_before(fn: Callable[[], object]) -> None:
    """The scope of the floor's empty call just before the measured one (called as `_in_call` calls fn)."""
    fn()


def _floor_after(fn: Callable[[], object]) -> None:
    """The scope of the floor's empty call just after the measured one."""
    fn()


_SCOPES = tuple(scope.__name__ for scope in (_in_call, _floor_before, _floor_after))
_SCOPE_FILE = _in_call.__code__.co_filename
_NO_FRAME = "no Python frame"


class _Scopes:
    """The scope of a record by its Python stack, cached by stack id: the innermost of `_SCOPES` on it,
    `_NO_FRAME` when it has no Python frame (a native thread, or the tracker starting), else None
    (outside: the tracker's own frames, other Python threads, code around the call)."""

    def __init__(self):
        self._by_stack: dict[int, str | None] = {}

    def __call__(self, record) -> str | None:
        key = record.stack_id
        if key not in self._by_stack:
            frames = record.stack_trace()
            self._by_stack[key] = _NO_FRAME if not frames else next(
                (function for function, file, _ in frames if function in _SCOPES and file == _SCOPE_FILE), None)
        return self._by_stack[key]

    def in_call(self, record, is_python: bool) -> bool:
        """Whether a record counts as the call's: made under its frame, or, for the system allocator, by a
        thread with no Python frame (torch's and BLAS's worker pools)."""
        scope = self(record)
        return scope == _in_call.__name__ or (scope == _NO_FRAME and not is_python)


class AllocationTracker:
    """Context manager that traces allocations; `call(fn)` inside it makes the one call it counts, and
    on exit `.allocations` holds that call's count less the tracker's floor (None when no call was
    made). `python_allocators=False` skips the Python-allocator tracing (faster; no `python_*` counts)."""

    def __init__(self, device: str | Device = "cpu", python_allocators: bool = True, sites: bool = False,
                 attribute: int = 0):
        self.device = resolve_device(device)
        self.python_allocators = bool(python_allocators)
        self.sites = bool(sites)
        self.attribute = int(attribute)  # > 0: read an `Attribution` keeping this many sites of each kind
        self.allocations: Allocations | None = None
        self.attribution: Attribution | None = None
        self.call_s = 0.0
        self._called = False
        self._tracker = None
        self._tmpdir = None
        self._path = ""
        self._stats_before = None
        self._in_use_before = 0

    def call(self, fn: Callable[[], object]) -> None:
        """Call `fn` once in the count's scope, between the floor's two empty calls; `call_s` is its time.
        fn's result is dropped inside the scope, as a discarded call's would be."""
        if self._called:
            raise RuntimeError("an AllocationTracker counts one call; start another tracker for the next")
        self._called = True
        _floor_before(_empty)
        start = perf_counter()
        _in_call(fn)
        self.call_s = perf_counter() - start
        _floor_after(_empty)

    def __enter__(self) -> "AllocationTracker":
        if self.device.is_cuda:
            self.device.synchronize()
            self._stats_before = _cuda_counters(self.device)
            self._in_use_before = cuda_stat(self.device.index, "allocated_bytes", "current")
            self.device.reset_peak()
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
            if not self._called:
                return
            self.device.synchronize()
            count0, bytes0 = self._stats_before
            count1, bytes1 = _cuda_counters(self.device)
            peak = cuda_stat(self.device.index, "allocated_bytes", "peak")
            self.allocations = Allocations(count1 - count0, bytes1 - bytes0, SOURCE_CUDA,
                                           peak_bytes=max(0, peak - self._in_use_before))
            return
        try:
            start = perf_counter()
            self._tracker.__exit__(*exc)
            if exc[0] is None and self._called and self.attribute:
                peak, temporary, allocated, peak_bytes, unattributed = _read_attribution(
                    self._path, self.python_allocators, self.attribute)
                self.attribution = Attribution(peak_bytes, peak, temporary, allocated, self.call_s,
                                               perf_counter() - start, unattributed, self.python_allocators)
            elif exc[0] is None and self._called:
                self.allocations = _read_memray(self._path, self.python_allocators, self.sites)
        finally:
            self._tmpdir.cleanup()


def _cuda_counters(device: Device) -> tuple[int, int]:
    """Allocations and bytes handed out so far (memory_stats' allocation.all.allocated and
    allocated_bytes.all.allocated)."""
    return (cuda_stat(device.index, "allocation", "allocated"),
            cuda_stat(device.index, "allocated_bytes", "allocated"))


def _allocator_types() -> tuple[set, set]:
    """memray's allocator types of the system allocator's allocating calls, and of Python's."""
    import memray

    return ({getattr(memray.AllocatorType, name) for name in _ALLOCATING},
            {getattr(memray.AllocatorType, name) for name in _PYTHON_ALLOCATING})


def _read_memray(path: str, python_allocators: bool, sites: bool = False) -> Allocations:
    """The call's records (`_Scopes.in_call`) summed, system and Python apart, less the floor: the smaller
    count of the two empty calls around it (the first traced run of a code object in a process makes one
    more allocation, so the first empty call can count one more). The tracked peak is the bytes of the
    call's records live at the high-water mark."""
    import memray

    allocating, python = _allocator_types()
    scopes = _Scopes()
    call = _in_call.__name__
    counts = {scope: {False: 0, True: 0} for scope in _SCOPES}  # by scope, then by is_python
    nbytes = {False: 0, True: 0}
    reader = memray.FileReader(path)
    for record in reader.get_allocation_records():
        is_python = record.allocator in python
        if not is_python and record.allocator not in allocating:
            continue
        scope = call if scopes.in_call(record, is_python) else scopes(record)
        if scope in counts:
            counts[scope][is_python] += record.n_allocations
        if scope == call:
            nbytes[is_python] += record.size * record.n_allocations
    floor = {kind: min(counts[_floor_before.__name__][kind], counts[_floor_after.__name__][kind])
             for kind in (False, True)}
    at_peak = [record for record in reader.get_high_watermark_allocation_records(merge_threads=True)
               if scopes.in_call(record, record.allocator in python)]
    peak = sum(record.size for record in at_peak)
    found = _peak_sites(at_peak, peak) if sites else None
    system = dict(count=counts[call][False] - floor[False], bytes=nbytes[False], source=SOURCE_MEMRAY,
                  peak_bytes=peak, sites=found, floor_count=floor[False])
    if not python_allocators:
        return Allocations(**system)
    return Allocations(**system, python_count=counts[call][True] - floor[True], python_bytes=nbytes[True],
                       floor_python_count=floor[True])


def _frame_text(frame) -> str:
    function, file, line = frame
    return f"{short_path(file)}:{line} in {function}"


def _site_of(frames) -> tuple[tuple[str, int, str], str]:
    """(file, line, function) of a stack's site, and its innermost frame as text where that is another frame."""
    if not frames:
        return ("", 0, NATIVE), ""
    site = next((frame for frame in frames if not is_library(frame[1])), frames[0])
    function, file, line = site
    return (file, line, function), "" if site == frames[0] else _frame_text(frames[0])


def _group_sites(records, total: int, kept: int, stacks: dict | None = None) -> tuple[PeakSite, ...]:
    """Records (memray's, with `.size` their bytes, `.n_allocations` and a stack) grouped by their
    site, largest first; `share` is of `total`. `stacks` caches a stack's site by its id."""
    grouped: dict[tuple[str, int, str], list] = {}
    stacks = {} if stacks is None else stacks
    for record in records:
        key = record.stack_id
        if key not in stacks:
            stacks[key] = _site_of(record.stack_trace())
        site, inner = stacks[key]
        totals = grouped.setdefault(site, [0, 0, {}])
        totals[0] += record.size
        totals[1] += record.n_allocations
        totals[2][inner] = totals[2].get(inner, 0) + record.size
    ranked = sorted(grouped.items(), key=lambda item: (-item[1][0], item[0]))[:kept]
    return tuple(PeakSite(file, line, function, size, n, size / total if total else 0.0,
                          max(inners.items(), key=lambda item: item[1])[0])
                 for (file, line, function), (size, n, inners) in ranked)


def _peak_sites(at_peak, peak: int) -> tuple[PeakSite, ...]:
    """The live allocations at the peak grouped by their site (`PeakSite`), largest first."""
    return _group_sites(at_peak, peak, SITES_KEPT)


@dataclass(frozen=True)
class Attribution:
    """What an attribution pass (one more traced call, `attribute_allocations`) saw, by site: the
    allocations live at its tracked peak (`peak`), those freed soon after they were made (`temporary`,
    memray's temporary allocations) and every allocation made (`allocated`), each largest first.
    `call_s` is the traced call, `read_s` stopping the tracker and reading and grouping its records:
    the pass's cost. `unattributed_bytes` of the peak had no Python frame on their stack."""

    peak_bytes: int
    peak: tuple[PeakSite, ...]
    temporary: tuple[PeakSite, ...]
    allocated: tuple[PeakSite, ...]
    call_s: float
    read_s: float
    unattributed_bytes: int = 0
    python_allocators: bool = True

    def sites(self, kind: str) -> tuple[PeakSite, ...]:
        if kind not in SITE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(SITE_KINDS)}, got {kind!r}")
        return getattr(self, kind)

    def to_dict(self) -> dict:
        """JSON-shaped (sites as lists of dicts), as a Measurement carries it across a process boundary."""
        return {**dataclasses.asdict(self), **{kind: [dataclasses.asdict(site) for site in getattr(self, kind)]
                                               for kind in SITE_KINDS}}

    @classmethod
    def from_dict(cls, data: dict) -> "Attribution":
        values = dict(data)
        for kind in SITE_KINDS:
            values[kind] = tuple(PeakSite(**site) for site in data.get(kind, ()))
        return cls(**values)


def _read_attribution(path: str, python_allocators: bool, kept: int = ATTRIBUTION_KEPT) -> tuple:
    """(peak, temporary, allocated, peak bytes, unattributed bytes) of a tracker's file, from the call's
    records only, as `_read_memray` reads them."""
    import memray

    allocating, python = _allocator_types()
    scopes = _Scopes()

    def in_call(record) -> bool:
        return scopes.in_call(record, record.allocator in python)

    reader = memray.FileReader(path)
    at_peak = [r for r in reader.get_high_watermark_allocation_records(merge_threads=True) if in_call(r)]
    peak = sum(record.size for record in at_peak)
    temporary = [r for r in reader.get_temporary_allocation_records(merge_threads=True, threshold=TEMPORARY_THRESHOLD)
                 if (r.allocator in allocating or r.allocator in python) and in_call(r)]
    allocated = [r for r in reader.get_allocation_records()
                 if (r.allocator in allocating or r.allocator in python) and in_call(r)]
    stacks: dict = {}
    unattributed = sum(r.size for r in at_peak if not r.stack_trace(max_stacks=1))
    return (_group_sites(at_peak, peak, kept, stacks),
            _group_sites(temporary, sum(r.size for r in temporary), kept, stacks),
            _group_allocated(allocated, kept, stacks),
            peak, unattributed)


def _group_allocated(records, kept: int, stacks: dict) -> tuple[PeakSite, ...]:
    """`get_allocation_records` gives one record per call (size: that call's bytes): the same grouping."""

    class _Total:  # the aggregated view `_group_sites` reads
        __slots__ = ("size", "n_allocations", "stack_id", "stack_trace")

    rows = []
    for record in records:
        row = _Total()
        row.size, row.n_allocations = record.size * record.n_allocations, record.n_allocations
        row.stack_id, row.stack_trace = record.stack_id, record.stack_trace
        rows.append(row)
    return _group_sites(rows, sum(row.size for row in rows), kept, stacks)


def attribute_allocations(fn: Callable[[], object], python_allocators: bool = False,
                          kept: int = ATTRIBUTION_KEPT) -> Attribution:
    """Call `fn` once more under memray and say where its memory went, by source line (`Attribution`).

    By default only the system allocator is traced (buffers: NumPy and torch CPU tensors, large Python
    objects): memray calls an allocation temporary when it is freed before `TEMPORARY_THRESHOLD` other
    allocations are made, and with Python's allocator traced the small objects made between a
    buffer's allocation and its free would hide every buffer's churn. `python_allocators=True` adds
    Python's small objects (the peak sites then add up to the tracked peak). CPU memory only: memray
    sees the host's allocators (on CUDA, the host side of a step)."""
    tracker = AllocationTracker("cpu", python_allocators, attribute=kept)
    with tracker:
        tracker.call(fn)
    return tracker.attribution


def count_allocations(fn: Callable[[], object], device: str | Device = "cpu",
                      python_allocators: bool = True, sites: bool = False) -> Allocations:
    """Call `fn` (a Python callable: function, lambda, closure) once under the device's allocation tracker,
    counting that call alone, less the tracker's floor (`AllocationTracker.call`); its result is discarded."""
    with AllocationTracker(device, python_allocators, sites) as tracker:
        tracker.call(fn)
    return tracker.allocations
