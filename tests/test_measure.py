"""benchlib.measure in-process: devices, GC pauses, allocations, measure, Measurement, timeline."""
import gc
import os
import json
import threading
import time

import numpy as np
import pandas as pd  # loaded before any timeline starts: importing it inside one moves RSS
import pytest
import torch

from benchlib.measure import (AllocationTracker, Allocations, AllocationTrackingUnavailable, Device, measure_steps,
                              DeviceError, GCMonitor, Measurement, tracked_objects, MemoryTimeline,
                              count_allocations, mark, measure, resolve_device)
from benchlib.measure import devices as devices_module
from benchlib.measure.devices import hwm_resettable
from benchlib.measure.timeline import timeline_from_json, timeline_to_json

# Counts this process's own allocations and threads: an xdist worker's own thread would add to them.
pytestmark = pytest.mark.serial

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="checks the error for a missing GPU; this machine has one")
needs_hwm = pytest.mark.skipif(not hwm_resettable(),
                               reason="CPU peak needs a resettable VmHWM (Linux /proc/self/clear_refs)")

MB = 1_000_000


# ---------------------------------------------------------------- devices

def test_cpu_device_names_itself():
    dev = resolve_device("cpu")
    assert (dev.name, dev.kind, dev.index) == ("cpu", "cpu", None)
    assert dev.torch == torch.device("cpu")
    assert dev.describe()["device"] == "cpu"
    assert resolve_device(" CPU ") == dev
    assert resolve_device(dev) is dev
    assert resolve_device(torch.device("cpu")) == dev


def test_auto_picks_cuda_only_when_present():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").kind == expected
    assert resolve_device().kind == expected


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:-1", "cuda0", "mps", "", 3, None])
def test_malformed_device_lists_valid_forms(spec):
    with pytest.raises(DeviceError, match=r'valid forms: "auto", "cpu", "cuda", "cuda:N"'):
        resolve_device(spec)


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_request_without_cuda_says_what_is_available(spec):
    with pytest.raises(DeviceError, match=r'CUDA is not available; available: "cpu" only'):
        resolve_device(spec)


def test_missing_cuda_index_lists_existing_devices(monkeypatch):
    monkeypatch.setattr(devices_module, "_cuda_count", lambda: 2)
    with pytest.raises(DeviceError, match=r'available: "cpu", "cuda:0", "cuda:1"'):
        resolve_device("cuda:5")


def test_device_rejects_inconsistent_fields():
    with pytest.raises(DeviceError):
        Device("cuda")
    with pytest.raises(DeviceError):
        Device("tpu")


@needs_hwm
def test_cpu_peak_sees_a_touched_buffer_after_reset():
    dev = resolve_device("cpu")
    dev.reset_peak()
    baseline = dev.memory_in_use()
    buffer = np.ones(10 * MB // 8)
    del buffer
    # The kernel batches RSS counter updates, so VmHWM can lag by a few hundred KiB.
    assert dev.peak_memory() - baseline >= 9 * MB


@pytest.mark.skipif(not hwm_resettable(), reason="needs Linux VmHWM")
def test_as_a_training_process_the_peak_is_the_whole_lifes_and_never_reset(monkeypatch):
    # fit's policy: a buffer freed before the measured steps still counts, as it does for the OOM killer
    dev = resolve_device("cpu")
    dev.reset_peak()
    before = dev.memory_in_use()
    buffer = np.ones(200 * MB // 8)
    del buffer
    monkeypatch.setenv(devices_module.KEEP_HEAP_ENV, "1")
    dev.reset_peak()
    assert dev.peak_memory() - before >= 190 * MB
    monkeypatch.delenv(devices_module.KEEP_HEAP_ENV)
    dev.reset_peak()
    assert dev.peak_memory() - before < 100 * MB


@pytest.mark.skipif(not (hwm_resettable() and devices_module.heap_trim_available()),
                    reason="needs Linux VmHWM and glibc's malloc_trim")
def test_cpu_reset_peak_hands_freed_heap_back_so_small_buffers_count_again():
    # 64 KiB buffers come from glibc's heap; freed, they stay resident unless trimmed. A warm-up
    # call that left them resident would hide the next call's identical buffers from the peak.
    def small_buffers():
        return [np.ones(8 * 1024) for _ in range(800)]  # 800 x 64 KiB = 52 MB

    dev = resolve_device("cpu")
    kept = small_buffers()
    pin = np.ones(8 * 1024)  # above them on the heap: glibc cannot trim the heap's top by itself
    del kept
    dev.reset_peak()
    baseline = dev.memory_in_use()
    kept = small_buffers()
    assert dev.peak_memory() - baseline >= 40 * MB
    del kept, pin

# ---------------------------------------------------------------- GC pauses

def test_gc_monitor_sees_forced_collection_and_unregisters():
    before = list(gc.callbacks)
    with GCMonitor() as outer:
        with GCMonitor() as inner:
            gc.collect()
        gc.collect(0)
    assert gc.callbacks == before
    assert [p.generation for p in inner.pauses].count(2) >= 1
    assert outer.count >= inner.count + 1
    assert 0 in [p.generation for p in outer.pauses]
    assert outer.seconds > 0 and all(p.duration_s >= 0 for p in outer.pauses)
    assert all(p.tracked_before == -1 and p.count_s == 0 for p in outer.pauses)  # not counted unless asked


class _Cycle:
    def __init__(self):
        self.me = self


def test_gc_monitor_records_collected_uncollectable_and_tracked_objects():
    gc.collect()
    for _ in range(50):
        _Cycle()  # 50 unreachable cycles of one object each
    with GCMonitor(count_tracked=True) as monitor:
        gc.collect(2)
    (pause,) = [p for p in monitor.pauses if p.generation == 2]
    assert pause.collected >= 50 and pause.uncollectable == 0
    # it walked every object the collector tracks, the 50 garbage objects among them
    assert pause.tracked_before >= len(gc.get_objects()) + 50 - 10
    assert pause.count_s > 0


def test_tracked_objects_counts_the_generations_a_collection_walks():
    gc.collect()
    gc.disable()  # no collection moves the new lists out of generation 0
    try:
        young = tracked_objects(0)
        keep = [[i] for i in range(1000)]  # 1000 new tracked lists (and the list holding them)
        assert tracked_objects(0) == young + 1001
        assert abs(tracked_objects(2) - len(gc.get_objects())) <= 3  # the lists the counts build themselves
    finally:
        gc.enable()
    del keep


def test_gc_monitor_unregisters_on_exception():
    before = list(gc.callbacks)
    with pytest.raises(KeyError):
        with GCMonitor():
            raise KeyError("boom")
    assert gc.callbacks == before


def test_gc_monitor_refuses_reentry_of_same_instance():
    monitor = GCMonitor()
    with monitor:
        with pytest.raises(RuntimeError, match="already active"):
            monitor.__enter__()


# ---------------------------------------------------------------- allocations

def test_count_allocations_sees_one_numpy_buffer():
    allocs = count_allocations(lambda: np.empty(10 * MB), "cpu")
    assert (allocs.count, allocs.bytes, allocs.source) == (1, 80 * MB, "memray")
    assert allocs.python_count < 20  # the array object and the call's own small objects
    assert 80 * MB <= allocs.peak_bytes < 80 * MB + 4096  # the buffer, live at the peak, and the array object
    plain = count_allocations(lambda: np.empty(10 * MB), "cpu", python_allocators=False)
    assert plain == Allocations(1, 80 * MB, "memray", peak_bytes=plain.peak_bytes, floor_count=0)
    assert plain.peak_bytes >= 80 * MB


def test_python_allocator_tracing_counts_the_small_objects_malloc_never_sees():
    def make(n):
        return lambda: [object() for _ in range(n)]

    few, many = count_allocations(make(100)), count_allocations(make(1100))
    assert many.python_count - few.python_count >= 1000  # one per object, plus the list's growth
    assert many.count - few.count < 50  # pymalloc serves them from arenas it already holds
    assert count_allocations(make(100), python_allocators=False).python_count is None


def test_count_allocations_counts_each_buffer():
    allocs = count_allocations(lambda: [np.empty(MB // 8) for _ in range(5)])
    assert allocs.count >= 5 and 5 * MB <= allocs.bytes < 5 * MB + 64 * 1024


_SLOTS = [None] * 200


def _fill(n):
    """A call making exactly n objects CPython's allocator hands out, plus its range and the range's iterator
    (ints below 257 are cached, and `object()` has no free list)."""
    def fill():
        for slot in range(n):
            _SLOTS[slot] = object()
    return fill


def _counted_twice(fn):
    """The second count of fn: the first traced run of a code object in a process also builds the line table
    the tracer reads (one more Python allocation, once; docs/measuring.md)."""
    count_allocations(fn)
    return count_allocations(fn)


def test_an_empty_call_counts_nothing_once_the_floor_is_subtracted():
    empty = _counted_twice(lambda: None)
    assert (empty.count, empty.python_count) == (0, 0)
    assert empty.floor_count == 0 and empty.floor_python_count >= 0


def test_n_python_objects_count_n_plus_the_loops_own_two():
    counts = {n: _counted_twice(_fill(n)) for n in (0, 100, 200)}
    assert {n: allocations.python_count for n, allocations in counts.items()} == {0: 2, 100: 102, 200: 202}
    assert {allocations.count for allocations in counts.values()} == {0}  # pymalloc's arenas: no malloc


def test_work_around_the_call_and_other_threads_are_outside_the_count():
    alone = _counted_twice(_fill(100)).python_count
    with AllocationTracker("cpu") as tracker:
        setup = [object() for _ in range(1000)]  # in the tracker's session, outside its call
        tracker.call(_fill(100))
        with pytest.raises(RuntimeError, match="one call"):
            tracker.call(_fill(100))
    assert len(setup) == 1000 and tracker.allocations.python_count == alone

    _counting_while_another_thread_allocates()
    waiting, made = _counting_while_another_thread_allocates()
    assert made == 1000 and (waiting.count, waiting.python_count) == (0, 0)


def _counting_while_another_thread_allocates():
    """The count of a call that makes nothing while another thread makes 1,000 objects, and how many it made."""
    go, done, made = [False], [False], []

    def other_thread():  # waits without allocating, allocates while the call waits, then lets it return
        while not go[0]:
            pass
        made.extend(object() for _ in range(1000))
        done[0] = True

    def waits_for_the_other_thread():
        go[0] = True
        while not done[0]:
            pass

    thread = threading.Thread(target=other_thread)
    thread.start()
    waiting = count_allocations(waits_for_the_other_thread)
    thread.join()
    return waiting, len(made)


def test_nested_memray_is_a_clear_error():
    with AllocationTracker("cpu"):
        with pytest.raises(AllocationTrackingUnavailable, match="already active"):
            count_allocations(lambda: None)


# ---------------------------------------------------------------- measure

def test_measure_sees_known_allocation_and_forced_gc():
    def fn():
        gc.collect()
        return np.ones(5 * MB)  # 40 MB: above glibc's largest mmap threshold, so RSS sees it

    m = measure(fn, warmup=1, repeats=3, name="ones")
    assert (m.alloc_count, m.alloc_bytes, m.alloc_source) == (1, 40 * MB, "memray")
    assert m.alloc_count_python > 0 and "Python allocation" in str(m)
    assert len(m.times_s) == 3 and all(t > 0 for t in m.times_s)
    assert m.gc_count >= 3 and 0 < m.gc_seconds <= sum(m.times_s)
    assert 0 < m.gc_fraction <= 1
    assert m.name == "ones" and m.device == "cpu"
    if hwm_resettable():
        assert m.peak_bytes >= 39 * MB


def test_measure_without_allocation_pass_leaves_fields_unset():
    m = measure(lambda: None, warmup=0, repeats=2, track_allocations=False)
    assert m.alloc_count is None and m.alloc_bytes is None and m.alloc_source is None
    assert "allocation" not in str(m)


def test_measure_allocation_pass_is_separate_from_timed_repeats():
    calls = []
    measure(lambda: calls.append(1), warmup=2, repeats=3, track_allocations=True)
    assert len(calls) == 2 + 3 + 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(repeats=0), "repeats must be an integer >= 1"),
    (dict(warmup=-1), "warmup must be an integer >= 0"),
    (dict(timeline=0), "timeline must be True, False or a sampling interval in seconds > 0"),
    (dict(track_allocations="lines"), "track_allocations must be True, False or 'sites'"),
    (dict(device="gpu"), "valid forms"),
])
def test_measure_refuses_bad_arguments_before_calling(kwargs, message):
    calls = []
    with pytest.raises(ValueError, match=message):
        measure(lambda: calls.append(1), **kwargs)
    assert calls == []


def test_measure_steps_takes_the_tracked_count_out_of_the_step_and_the_pause(monkeypatch):
    """A fake clock that only moves while the tracked objects are counted (5 s) or collected (1 s):
    the step's time is the collection alone, and the count is reported beside it."""
    from benchlib.measure import core, gcmonitor

    clock = [0.0]
    monkeypatch.setattr(core, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(gcmonitor, "perf_counter", lambda: clock[0])

    def counting(generation):
        clock[0] += 5.0
        return 1234

    def step(index):
        def advance(phase, info):
            if phase == "start":
                clock[0] += 1.0
        gc.callbacks.append(advance)  # registered after the monitor's: runs between its start and stop
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(advance)

    monkeypatch.setattr(gcmonitor, "tracked_objects", counting)
    run = measure_steps(step, 1, track_peak=False, count_tracked=True)
    (pause,) = run.gc_pauses[0]
    assert (pause.tracked_before, pause.count_s, pause.duration_s) == (1234, 5.0, 1.0)
    assert run.step_s == (1.0,)


def test_measure_steps_attributes_each_collection_to_its_step():
    seen = []

    def step(index):
        if index == 1:
            gc.collect()
            gc.collect(0)
        return np.full(MB, index)

    run = measure_steps(step, 3, after_step=lambda index, result: seen.append((index, float(result[0]))))
    assert run.gc_count == (0, 2, 0) and run.gc_generations == ((), (2, 0), ())
    assert [p.generation for p in run.gc_pauses[1]] == [2, 0]
    assert run.gc_s[1] > 0 and run.gc_s[0] == run.gc_s[2] == 0 and run.gc_seconds == run.gc_s[1]
    assert len(run.step_s) == 3 and all(t > 0 for t in run.step_s)
    assert seen == [(0, 0.0), (1, 1.0), (2, 2.0)] and run.result[0] == 2
    assert run.baseline_bytes > 0
    if hwm_resettable():
        assert run.peak_bytes >= MB * 8 * 0.9


def test_measure_steps_without_peak_leaves_the_allocator_alone(monkeypatch):
    resets = []
    monkeypatch.setattr(Device, "reset_peak", lambda self: resets.append(1))
    run = measure_steps(lambda index: index, 2, track_peak=False)
    assert resets == [] and run.peak_bytes is None and run.baseline_bytes is None and run.result == 1


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_measure_steps_refuses_a_bad_count(n):
    with pytest.raises(ValueError, match="n \\(steps\\) must be an integer >= 1"):
        measure_steps(lambda index: None, n)


def test_measure_timeline_covers_timed_repeats():
    def fn():
        mark("work")
        return np.ones(MB)

    m = measure(fn, warmup=0, repeats=2, timeline=True, track_allocations=False)
    assert list(m.timeline.columns) == ["t_s", "bytes", "phase"]
    assert (m.timeline["phase"] == "work").sum() >= 2


def test_failing_function_leaves_no_monitor_timeline_or_tracker_behind():
    from benchlib.measure import timeline as timeline_module

    callbacks = list(gc.callbacks)

    def boom():
        raise ZeroDivisionError("in the measured function")

    with pytest.raises(ZeroDivisionError):
        measure(boom, warmup=0, timeline=True)
    with pytest.raises(ZeroDivisionError):
        count_allocations(boom)
    assert gc.callbacks == callbacks and timeline_module._active == []
    assert count_allocations(lambda: np.empty(MB)).count == 1  # memray was stopped


# ---------------------------------------------------------------- Measurement

JULIA_EXAMPLE = Measurement(
    name="", device="cpu", times_s=(0.1495,), gc_count=3, gc_seconds=0.1495 * 0.9945,
    alloc_count=10_690, alloc_bytes=1_331_000, alloc_source="memray",
    peak_bytes=812_000_000, baseline_bytes=100_000_000)


def test_str_is_julia_time_style():
    assert str(JULIA_EXAMPLE) == (
        "0.1495 s (10.69 k allocations: 1.331 MB, 99.45% gc time, peak +812.0 MB)")


def test_str_omits_unmeasured_parts_and_uses_small_units():
    m = Measurement(name="tiny", device="cpu", times_s=(2e-5, 3e-5, 4e-5), gc_count=0,
                    gc_seconds=0.0, alloc_count=1, alloc_bytes=64, alloc_source="memray")
    assert str(m) == "tiny: 30.00 μs (1 allocation: 64 bytes, 0.00% gc time)"


def test_statistics():
    m = Measurement(name="", device="cpu", times_s=(1.0, 2.0, 3.0, 4.0, 5.0), gc_count=1,
                    gc_seconds=1.5)
    assert (m.median_s, m.iqr_s, m.gc_fraction) == (3.0, 2.0, 0.1)


def test_to_dict_from_dict_round_trip_through_json():
    with MemoryTimeline("cpu") as tl:
        tl.mark("forward")
    m = Measurement(**{**JULIA_EXAMPLE.__dict__, "timeline": tl.frame()})
    data = json.loads(json.dumps(m.to_dict()))
    back = Measurement.from_dict(data)
    assert back == m and back.to_dict() == m.to_dict()
    assert back.timeline.equals(m.timeline)
    assert Measurement.from_dict(JULIA_EXAMPLE.to_dict()).timeline is None


def test_from_dict_names_missing_keys():
    with pytest.raises(ValueError, match=r"missing \['peak_bytes'\]"):
        Measurement.from_dict({k: v for k, v in JULIA_EXAMPLE.to_dict().items()
                               if k != "peak_bytes"})


def test_a_counts_record_holds_the_floor_subtracted_from_it():
    m = measure(_fill(100), warmup=1, repeats=1)
    assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    rows = m.records(benchmark="calibration", case="fill", engine="numpy", dtype="float64", params={"n": 3})
    params = {row["metric"]: json.loads(row["params"]) for row in rows}
    assert params["alloc_count"] == {"n": 3, "floor": m.alloc_floor} and m.alloc_floor == 0
    assert params["alloc_count_python"] == {"n": 3, "floor": m.alloc_floor_python}
    assert params["time"] == params["alloc_bytes"] == {"n": 3}


def test_records_are_tidy_rows():
    rows = JULIA_EXAMPLE.records(benchmark="calibration", case="example", engine="numpy",
                                 dtype="float64", params={"n": 3})
    metrics = [r["metric"] for r in rows]
    assert metrics == ["time", "gc_count", "gc_time", "alloc_count", "alloc_bytes",
                       "peak_bytes", "baseline_bytes"]
    assert all(r["case"] == "example" for r in rows)
    assert all(r["device"] == "cpu" and json.loads(r["params"]) == {"n": 3} for r in rows)
    assert rows[4]["value"] == JULIA_EXAMPLE.alloc_bytes


# ---------------------------------------------------------------- timeline

def test_timeline_sees_200mb_allocation_and_phase_marks():
    with MemoryTimeline("cpu", interval_s=0.001) as tl:
        mark("allocate")
        buffer = np.ones(200 * MB // 8)
        mark("hold")
        for _ in range(5000):  # until the background thread has sampled the held buffer
            if (tl.frame()["phase"] == "hold").sum() >= 2:
                break
            time.sleep(0.001)
        del buffer
        mark("freed")
    frame = tl.frame()
    assert list(frame.columns) == ["t_s", "bytes", "phase"]
    assert str(frame["bytes"].dtype) == "int64" and frame["t_s"].is_monotonic_increasing
    assert list(dict.fromkeys(frame["phase"])) == ["", "allocate", "hold", "freed"]
    assert frame.loc[frame["phase"] == "hold", "bytes"].min() >= 200 * MB
    assert frame.loc[frame["phase"] == "freed", "bytes"].iloc[-1] < 20 * MB
    assert len(frame) > 5  # the background thread sampled, beyond the start, marks and end
    assert [p for _, p in tl.marks] == ["allocate", "hold", "freed"]


def test_mark_reaches_every_active_timeline_and_is_a_noop_otherwise():
    mark("nobody listens")
    with MemoryTimeline("cpu", interval_s=1.0) as a, MemoryTimeline("cpu", interval_s=1.0) as b:
        mark("shared")
    mark("after")
    assert [p for _, p in a.marks] == [p for _, p in b.marks] == ["shared"]


def test_timeline_samples_leave_nothing_for_the_collector():
    """Stored samples must not count towards generation 0: if they did, the sampler would set off
    GC pauses that `measure` attributes to the measured code."""
    gc.collect()
    gc.disable()
    try:
        with MemoryTimeline("cpu", interval_s=60) as tl:
            before = gc.get_count()[0]
            for i in range(3000):
                tl.mark("forward" if i % 2 else "backward")  # a mark stores a mark and a sample
            grown = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert grown < 50  # was 2 per mark
    frame = tl.frame()
    assert len(frame) == 1 + 3000 + 1 and len(tl.marks) == 3000
    assert list(frame["phase"][1:5]) == ["backward", "forward", "backward", "forward"]


def test_timeline_refuses_bad_interval():
    with pytest.raises(ValueError, match="positive"):
        MemoryTimeline("cpu", interval_s=0)


def test_a_gauge_is_read_at_every_sample_and_crosses_json_with_its_roles():
    held = {"saved": 100}

    def gauge():
        return dict(held)

    with MemoryTimeline("cpu", interval_s=60, gauge=gauge) as tl:
        tl.mark("forward")
        held.update(saved=300, gradients=40)  # a role first reported later was 0 before
        tl.mark("backward")
    frame = tl.frame()
    assert list(frame.columns) == ["t_s", "bytes", "phase", "saved", "gradients"]
    assert frame["saved"].tolist() == [100, 100, 300, 300] and frame["gradients"].tolist() == [0, 0, 40, 40]
    back = timeline_from_json(json.loads(json.dumps(timeline_to_json(frame))))
    pd.testing.assert_frame_equal(back, frame)


def test_a_gauge_may_not_shadow_the_timelines_own_columns():
    with pytest.raises(ValueError, match="cannot be named 'bytes'"):
        with MemoryTimeline("cpu", interval_s=60, gauge=lambda: {"bytes": 1}):
            pass
    with pytest.raises(TypeError, match="gauge must be a callable"):
        MemoryTimeline("cpu", gauge={"saved": 1})


# ---------------------------------------------------------------- CUDA

@needs_cuda
@pytest.mark.cuda
def test_cuda_device_and_allocations():
    dev = resolve_device("cuda")
    assert dev.name == f"cuda:{torch.cuda.current_device()}" and dev.torch.type == "cuda"
    allocs = count_allocations(lambda: torch.empty(MB, dtype=torch.float32, device=dev.torch), dev)
    assert allocs.count == 1 and 4 * MB <= allocs.bytes < 4 * MB + 512
    assert allocs.source == "cuda-caching-allocator"


@needs_cuda
@pytest.mark.cuda
def test_cuda_measure_peak_and_timeline():
    dev = resolve_device("cuda")

    def fn():
        mark("alloc")
        return torch.ones(50 * MB // 4, device=dev.torch)

    m = measure(fn, device=dev, warmup=0, repeats=2, timeline=True)
    assert m.alloc_count == 1 and m.peak_bytes >= 50 * MB
    assert m.timeline["bytes"].max() >= 50 * MB


def _fake_cuda_stats(seed):
    """The shape of torch.cuda.memory_stats_as_nested_dict: stat -> pool -> field -> int."""
    fields = ("current", "peak", "allocated", "freed")
    return {stat: {pool: {f: seed * (i + 1) * (j + 1) * (k + 1) for k, f in enumerate(fields)}
                   for j, pool in enumerate(("all", "small_pool", "large_pool"))}
            for i, stat in enumerate(("allocation", "segment", "allocated_bytes", "reserved_bytes"))}


@pytest.mark.parametrize("stats", [_fake_cuda_stats(7), {}], ids=["initialised", "no-context"])
def test_cuda_counters_read_what_torch_reports(stats, monkeypatch):
    """Without a GPU: the nested counters we read are the ones torch's flattened API names."""
    from benchlib.measure.allocations import _cuda_counters

    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "memory_stats_as_nested_dict", lambda device=None: stats)
    dev = Device("cuda", 0)
    assert dev.memory_in_use() == torch.cuda.memory_allocated(0)
    flat = torch.cuda.memory_stats(0)
    assert _cuda_counters(dev) == (flat.get("allocation.all.allocated", 0),
                                   flat.get("allocated_bytes.all.allocated", 0))


def test_cuda_tracker_counts_the_call_from_the_caching_allocator(monkeypatch):
    """Without a GPU: an AllocationTracker on a CUDA device resets the device's peak and counts the call's
    allocations, bytes and peak above what was in use, from the allocator's counters (faked here)."""
    stats = {stat: {"all": {"current": 0, "peak": 0, "allocated": 0, "freed": 0}}
             for stat in ("allocation", "allocated_bytes")}
    stats["allocated_bytes"]["all"].update(current=1000, peak=5000, allocated=9000)  # in use before the count
    resets = []

    def reset_peak(device=None):
        resets.append(device)
        stats["allocated_bytes"]["all"]["peak"] = stats["allocated_bytes"]["all"]["current"]

    def allocate(nbytes):
        counters = stats["allocated_bytes"]["all"]
        stats["allocation"]["all"]["allocated"] += 1
        counters["allocated"] += nbytes
        counters["current"] += nbytes
        counters["peak"] = max(counters["peak"], counters["current"])

    def free(nbytes):
        stats["allocated_bytes"]["all"]["current"] -= nbytes

    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "memory_stats_as_nested_dict", lambda device=None: stats)
        monkeypatch.setattr(module, "reset_peak_memory_stats", reset_peak)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    with AllocationTracker(Device("cuda", 0)) as tracker:
        tracker.call(lambda: (allocate(400), allocate(256), free(400)))
    assert resets == [0]
    assert tracker.allocations == Allocations(2, 656, "cuda-caching-allocator", peak_bytes=656)


def test_rss_fallback_without_proc_agrees_with_proc(monkeypatch):
    import psutil

    with_proc = devices_module.process_rss()
    monkeypatch.setattr(devices_module, "_statm_fd", lambda: None)
    without_proc = devices_module.process_rss()
    assert without_proc == psutil.Process().memory_info().rss
    assert abs(without_proc - with_proc) < 16 * 2**20


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_rss_after_fork_is_the_childs_own():
    devices_module.process_rss()  # open the descriptor in the parent
    ballast = np.ones(100 * MB // 8)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        del ballast
        import gc as child_gc

        child_gc.collect()
        os.write(write_fd, str(devices_module.process_rss()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child_rss = int(os.read(read_fd, 64))
    os.close(read_fd)
    os.close(write_fd)
    # the child freed its copy of the ballast; reading the parent's statm would include it
    assert child_rss < devices_module.process_rss() - 50 * MB
    del ballast


def test_torch_threads_sets_and_restores_the_count_even_on_error():
    from benchlib.measure import torch_threads

    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="integer >= 1"):
        with torch_threads(0):
            pass
