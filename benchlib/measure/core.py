"""`measure`: timed repeats with GC pauses and peak memory, then a separate allocation pass."""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Mapping

import numpy as np

from benchlib.units import format_bytes, format_count, format_seconds
from .allocations import AllocationTrackingUnavailable, attribute_allocations, count_allocations, memray_available
from .devices import Device, resolve_device
from .gcmonitor import GCMonitor
from .timeline import MemoryTimeline, timeline_from_json, timeline_to_json

_FIELDS = ("name", "device", "times_s", "gc_count", "gc_seconds", "alloc_count", "alloc_bytes",
           "alloc_source", "alloc_count_python", "alloc_bytes_python", "alloc_floor", "alloc_floor_python",
           "peak_bytes", "baseline_bytes", "tracked_peak_bytes", "peak_sites", "attribution", "timeline",
           "cuda_allocator", "phase_s")
# may be missing from a dict written before they existed
_OPTIONAL_FIELDS = ("attribution", "alloc_floor", "alloc_floor_python", "cuda_allocator", "phase_s")


@dataclass(frozen=True)
class Measurement:
    """One measured function. Allocation and peak fields are None when not measured."""

    name: str
    device: str
    times_s: tuple
    gc_count: int
    gc_seconds: float
    alloc_count: int | None = None
    alloc_bytes: int | None = None
    alloc_source: str | None = None
    alloc_count_python: int | None = None  # Python-allocator allocations (CPU; overlaps alloc_count)
    alloc_bytes_python: int | None = None
    alloc_floor: int | None = None  # the tracker's floor, already subtracted from alloc_count (memray)
    alloc_floor_python: int | None = None  # the same for alloc_count_python
    peak_bytes: int | None = None
    baseline_bytes: int | None = None
    tracked_peak_bytes: int | None = None  # the allocation pass's peak (allocations.Allocations.peak_bytes)
    peak_sites: tuple | None = None  # PeakSite dicts of that pass (`measure(..., track_allocations="sites")`)
    attribution: dict | None = field(default=None, compare=False, repr=False)  # Attribution.to_dict() of the extra pass (`attribute`)
    timeline: Any = field(default=None, compare=False, repr=False)
    cuda_allocator: dict | None = None  # the caching allocator over the timed calls (`Device.allocator_view`; CUDA)
    # seconds of each phase that made it ({phase: s}, `records.metrics.HARNESS_PHASES`): the instrument's own cost
    phase_s: dict | None = field(default=None, compare=False, repr=False)

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))

    @property
    def iqr_s(self) -> float:
        q25, q75 = np.percentile(self.times_s, [25, 75])
        return float(q75 - q25)

    @property
    def gc_fraction(self) -> float:
        """Share of the timed repeats' wall time spent in GC pauses."""
        total = sum(self.times_s)
        return self.gc_seconds / total if total > 0 else 0.0

    def __str__(self) -> str:
        parts = []
        if self.alloc_count is not None:
            noun = "allocation" if self.alloc_count == 1 else "allocations"
            parts.append(f"{format_count(self.alloc_count)} {noun}: "
                         f"{format_bytes(self.alloc_bytes)}")
        if self.alloc_count_python is not None:
            parts.append(f"{format_count(self.alloc_count_python)} Python "
                         f"{'allocation' if self.alloc_count_python == 1 else 'allocations'}: "
                         f"{format_bytes(self.alloc_bytes_python)}")
        parts.append(f"{100 * self.gc_fraction:.2f}% gc time")
        if self.peak_bytes is not None:
            parts.append(f"peak +{format_bytes(self.peak_bytes)}")
        prefix = f"{self.name}: " if self.name else ""
        return f"{prefix}{format_seconds(self.median_s)} ({', '.join(parts)})"

    def to_dict(self) -> dict:
        """JSON-able dict; the timeline becomes column lists."""
        out = {name: getattr(self, name) for name in _FIELDS if name != "timeline"}
        out["times_s"] = list(self.times_s)
        out["peak_sites"] = None if self.peak_sites is None else [dict(site) for site in self.peak_sites]
        out["timeline"] = None if self.timeline is None else timeline_to_json(self.timeline)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        missing = [name for name in _FIELDS if name not in data and name not in _OPTIONAL_FIELDS]
        unknown = sorted(set(data) - set(_FIELDS))
        if missing or unknown:
            raise ValueError(f"not a Measurement dict: missing {missing}, unknown {unknown}; "
                             f"expected keys {list(_FIELDS)}")
        values = {**dict.fromkeys(_OPTIONAL_FIELDS), **data}
        values["times_s"] = tuple(float(t) for t in data["times_s"])
        if data["peak_sites"] is not None:
            values["peak_sites"] = tuple(dict(site) for site in data["peak_sites"])
        if data["timeline"] is not None:
            values["timeline"] = timeline_from_json(data["timeline"])
        return cls(**values)

    def records(self, **labels) -> list[dict]:
        """Tidy rows via benchlib.records.make_record: one per timed repeat, then one per
        measured quantity; an allocation count's row holds the tracker's floor subtracted from it in
        params.floor. `labels` are make_record's (benchmark, engine, dtype, params...); case defaults
        to this measurement's name and device to its device."""
        from benchlib.records import make_record

        labels.setdefault("case", self.name)
        labels.setdefault("device", self.device)
        params = labels.pop("params", None) or {}
        rows = [make_record(**labels, params=params, metric="time", value=t, unit="s", repeat=i)
                for i, t in enumerate(self.times_s)]
        quantities = [("gc_count", self.gc_count, "count", None), ("gc_time", self.gc_seconds, "s", None),
                      ("alloc_count", self.alloc_count, "count", self.alloc_floor),
                      ("alloc_bytes", self.alloc_bytes, "B", None),
                      ("alloc_count_python", self.alloc_count_python, "count", self.alloc_floor_python),
                      ("alloc_bytes_python", self.alloc_bytes_python, "B", None),
                      ("peak_bytes", self.peak_bytes, "B", None),
                      ("baseline_bytes", self.baseline_bytes, "B", None),
                      ("tracked_peak_bytes", self.tracked_peak_bytes, "B", None)]
        rows += [make_record(**labels, params=params if floor is None else {**params, "floor": floor},
                             metric=metric, value=float(value), unit=unit)
                 for metric, value, unit, floor in quantities if value is not None]
        rows += [make_record(**labels, params=params, metric=metric, value=float(value),
                             unit="B" if metric.endswith("_bytes") else "count")
                 for metric, value in (self.cuda_allocator or {}).items()]
        if self.attribution is not None:
            from benchlib.analysis.sites import attribution_records

            rows += attribution_records(self.attribution, params=params, **labels)
        return rows


def _check_counts(warmup: int, repeats: int) -> None:
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")


@dataclass(frozen=True)
class StepTimes:
    """What `measure_steps` saw: per-step seconds, the GC pauses that began in each step, and memory.

    `gc_pauses[i]` holds the `GCPause`s that began in step i; `gc_count`, `gc_s` and
    `gc_generations` are per-step views of them. `peak_bytes` is the highest level above
    `baseline_bytes` over all steps (None where the platform cannot reset a peak, or when
    `track_peak=False`); `cuda_allocator` the caching allocator's view of the steps (CUDA with
    `track_peak`: `Device.allocator_view`); `result` is the last step's value.
    """

    step_s: tuple
    gc_pauses: tuple
    baseline_bytes: int | None
    peak_bytes: int | None
    timeline: Any = field(default=None, compare=False, repr=False)
    result: Any = field(default=None, compare=False, repr=False)
    cuda_allocator: dict | None = None

    @property
    def gc_count(self) -> tuple:
        return tuple(len(pauses) for pauses in self.gc_pauses)

    @property
    def gc_s(self) -> tuple:
        return tuple(sum(pause.duration_s for pause in pauses) for pauses in self.gc_pauses)

    @property
    def gc_generations(self) -> tuple:
        return tuple(tuple(pause.generation for pause in pauses) for pauses in self.gc_pauses)

    @property
    def gc_count_total(self) -> int:
        return int(sum(self.gc_count))

    @property
    def gc_seconds(self) -> float:
        return float(sum(self.gc_s))


TIMELINE_INTERVAL_S = 0.002  # seconds between a memory timeline's samples when `timeline=True`
SITES = "sites"  # track_allocations=SITES: the traced call's counts and the lines holding its peak


def timeline_interval(timeline: bool | float) -> float | None:
    """Seconds between samples for `timeline` (True: `TIMELINE_INTERVAL_S`; a number: itself), None for none."""
    if timeline is False or timeline is None:
        return None
    if timeline is True:
        return TIMELINE_INTERVAL_S
    if isinstance(timeline, (int, float)) and timeline > 0:
        return float(timeline)
    raise ValueError(f"timeline must be True, False or a sampling interval in seconds > 0, got {timeline!r}")


def measure_steps(step: Callable[[int], Any], n: int, *, device: str | Device = "cpu",
                  track_peak: bool = True, timeline: bool | float = False,
                  after_step: Callable[[int, Any], None] | None = None,
                  count_tracked: bool = False, gauge: Callable[[], Mapping[str, int]] | None = None) -> StepTimes:
    """The one measuring loop: `step(i)` for i in 0..n-1, each timed with the device synchronised
    before both clock reads, with the GC pauses that began in it.

    With `track_peak`, the peak is reset (on CPU glibc's freed heap is handed back first) and the
    baseline read once before the first step; without it nothing touches the allocator, for
    protocols that time single calls back to back. `after_step(i, result)` runs outside the timed
    region (e.g. to read a loss). Each step's result is held until just before the next step, as
    a caller would hold it; the last one is returned in `.result`. With `count_tracked` every
    pause carries the tracked objects it walked (`GCMonitor`); the time spent counting is taken
    out of the step's time. A `gauge` ({role: bytes now}) is read by the timeline at each sample.
    """
    if not callable(step):
        raise TypeError(f"step must be callable with the step index, got {type(step).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (steps) must be an integer >= 1, got {n!r}")
    interval = timeline_interval(timeline)
    dev = resolve_device(device)
    dev.synchronize()
    baseline = counters = None
    if track_peak:
        dev.reset_peak()
        baseline, counters = dev.memory_in_use(), dev.allocator_counters()
    times, step_pauses = [], []
    result = None
    if gauge is not None and not interval:
        raise ValueError("a gauge is read by the memory timeline: pass timeline=True (or an interval) with it")
    recorder = MemoryTimeline(dev, interval, gauge=gauge) if interval else None
    # The timeline's thread starts and stops outside the GC monitor: collections its set-up
    # triggers are the instrument's, not the measured code's.
    with recorder or nullcontext(), GCMonitor(count_tracked=count_tracked) as gc_monitor:
        for index in range(n):
            result = None
            seen = len(gc_monitor.pauses)
            dev.synchronize()
            start = perf_counter()
            result = step(index)
            dev.synchronize()
            elapsed = perf_counter() - start
            pauses = tuple(gc_monitor.pauses[seen:])
            times.append(elapsed - sum(pause.count_s for pause in pauses))
            step_pauses.append(pauses)
            if after_step is not None:
                after_step(index, result)
    peak = dev.peak_memory() if track_peak else None
    return StepTimes(step_s=tuple(times), gc_pauses=tuple(step_pauses), baseline_bytes=baseline,
                     peak_bytes=None if peak is None else max(0, peak - baseline),
                     timeline=None if recorder is None else recorder.frame(), result=result,
                     cuda_allocator=dev.allocator_view(counters))


def measure_with_result(fn: Callable[[], Any], *, device: str | Device = "cpu", warmup: int = 1,
                        repeats: int = 5, track_allocations: bool | str = True, timeline: bool | float = False,
                        attribute: bool = False,
                        gauge: Callable[[], Mapping[str, int]] | None = None) -> tuple[Measurement, Any]:
    """`measure` without a name, also returning the last timed repeat's result (for a case's check). The timed
    calls' timeline reads `gauge` ({role: bytes now}) at each sample, as a role timeline does."""
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    _check_counts(warmup, repeats)
    timeline_interval(timeline)
    if track_allocations not in (True, False, SITES):
        raise ValueError(f"track_allocations must be True, False or {SITES!r} (the lines holding the bytes live at "
                         f"the traced call's peak too), got {track_allocations!r}")
    dev = resolve_device(device)
    if attribute and not memray_available():
        raise AllocationTrackingUnavailable(
            "attribute=True (allocation sites) needs memray (Linux/macOS only): pip install memray")
    if track_allocations and not dev.is_cuda and not memray_available():
        raise AllocationTrackingUnavailable(
            "track_allocations=True needs memray on CPU (Linux/macOS only); install it or pass "
            "track_allocations=False")

    phases, started = {}, perf_counter()
    result = None
    for _ in range(warmup):
        result = None
        result = fn()
    result = None
    phases["warmup"], started = perf_counter() - started, perf_counter()
    steps = measure_steps(lambda _: fn(), repeats, device=dev, timeline=timeline, gauge=gauge)
    phases["timed"], started = perf_counter() - started, perf_counter()
    allocations = count_allocations(fn, dev, sites=track_allocations == SITES) if track_allocations else None
    if track_allocations:
        phases["allocation_pass"], started = perf_counter() - started, perf_counter()
    # The attribution pass comes after every other pass, so it changes none of their numbers.
    attribution = attribute_allocations(fn).to_dict() if attribute else None  # buffers: system allocator
    if attribute:
        phases["attribution_pass"] = perf_counter() - started
    measurement = Measurement(
        name="", device=dev.name, times_s=steps.step_s, gc_count=steps.gc_count_total,
        gc_seconds=steps.gc_seconds,
        alloc_count=None if allocations is None else allocations.count,
        alloc_bytes=None if allocations is None else allocations.bytes,
        alloc_source=None if allocations is None else allocations.source,
        alloc_count_python=None if allocations is None else allocations.python_count,
        alloc_bytes_python=None if allocations is None else allocations.python_bytes,
        alloc_floor=None if allocations is None else allocations.floor_count,
        alloc_floor_python=None if allocations is None else allocations.floor_python_count,
        peak_bytes=steps.peak_bytes, baseline_bytes=steps.baseline_bytes,
        tracked_peak_bytes=None if allocations is None else allocations.peak_bytes,
        peak_sites=None if allocations is None or allocations.sites is None else
        tuple(dataclasses.asdict(site) for site in allocations.sites),
        attribution=attribution, timeline=steps.timeline, cuda_allocator=steps.cuda_allocator, phase_s=phases)
    return measurement, steps.result


def time_call(fn: Callable[[], Any], device: str | Device = "cpu") -> float:
    """Seconds of one call of `fn` through `measure_steps` without touching the allocator.

    For protocols that time single calls one after another (cold vs warm), where `measure`'s
    per-call set-up (peak reset, which trims the heap on CPU) would touch the state the next call
    runs in.
    """
    return measure_steps(lambda _: fn(), 1, device=device, track_peak=False).step_s[0]


def measure(fn: Callable[[], Any], *, device: str | Device = "cpu", warmup: int = 1,
            repeats: int = 5, track_allocations: bool | str = True, timeline: bool | float = False,
            name: str = "", attribute: bool = False) -> Measurement:
    """Warm-up calls, timed repeats (GC pauses, peak above the baseline taken just before the
    first repeat, optional memory timeline: `timeline=True` samples every `TIMELINE_INTERVAL_S`, a
    number is the interval in seconds), then, if asked, one allocation-tracing call (its tracked
    peak, and with `track_allocations="sites"` the lines holding the bytes live at that peak), then with
    `attribute` one more traced call, the attribution pass (`Measurement.attribution`: sites at its
    peak, temporaries and all allocations by site, and what the pass cost)."""
    measurement, _ = measure_with_result(
        fn, device=device, warmup=warmup, repeats=repeats, track_allocations=track_allocations,
        timeline=timeline, attribute=attribute)
    return dataclasses.replace(measurement, name=name)
