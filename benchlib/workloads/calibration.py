"""Calibration: the ceilings other benchmarks compare against, and the instrument's own cost.

- `matmul_flops`: matrix-product FLOP/s (2·n³ per product), float32 and float64; NumPy and torch
  on CPU, torch on CUDA.
- `copy_bandwidth`: bytes read plus bytes written per second by a buffer-to-buffer copy.
- `sampler_overhead`: how much the MemoryTimeline's sampler thread slows a fixed workload of
  small torch operations (GIL-bound, the worst case), as a time ratio per sampling interval.
- `tracker_overhead`: how much memray's allocation tracing slows NumPy and torch workloads, with
  and without Python-allocator tracing (cases `tracker_overhead` and `tracker_overhead_python`;
  and, on CUDA, the cost of the caching allocator's counters), as time ratios.

Overhead ratios interleave plain and instrumented calls round by round, in a shuffled order,
so drift in the machine's speed affects both sides alike. Every function returns tidy records
(benchlib.records.make_record); `run_calibration` runs them all.
"""
from __future__ import annotations

import json
import random
import statistics
from typing import Callable

import numpy as np
import pandas as pd

from benchlib.errors import Refused
from benchlib.benchmark import Benchmark, Config, Parameter
from benchlib.measure import (AllocationTracker, Device, count_allocations, measure, measure_steps, resolve_device,
                              time_call, torch_threads)
from benchlib.records import make_record

MATMUL_DTYPES = ("float32", "float64")


def _check_positive_ints(name: str, values) -> list[int]:
    values = list(values)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                             for v in values):
        raise Refused(f"{name} must be a non-empty list of positive integers, got {values!r}")
    return values


def _check_dtypes(dtypes) -> list[str]:
    dtypes = list(dtypes)
    if not dtypes or any(d not in MATMUL_DTYPES for d in dtypes):
        raise Refused(f"dtypes must be a non-empty subset of {list(MATMUL_DTYPES)}, got {dtypes!r}")
    return dtypes


NUMPY_LIBRARY, TORCH_LIBRARY = "numpy", "torch"  # the libraries whose matmul ceiling is measured (a record's variant)


def _libraries(device: Device) -> list[str]:
    """NumPy runs on the CPU only; on CUDA the ceiling is torch's."""
    return [TORCH_LIBRARY] if device.is_cuda else [NUMPY_LIBRARY, TORCH_LIBRARY]


def _operands(library: str, device: Device, shape: tuple, dtype: str, count: int, seed: int = 0):
    import torch

    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(dtype) for _ in range(count)]
    if library == "numpy":
        return arrays
    return [torch.from_numpy(a).to(device.torch) for a in arrays]


def matmul_flops(device="cpu", sizes=None, dtypes=MATMUL_DTYPES, repeats: int = 5) -> list[dict]:
    """FLOP/s of an n×n by n×n product written into a preallocated output (one row per repeat)."""
    import torch

    device = resolve_device(device)
    if sizes is None:
        sizes = BENCHMARK.defaults()["matmul_sizes_cuda" if device.is_cuda else "matmul_sizes_cpu"]
    sizes, dtypes = _check_positive_ints("sizes", sizes), _check_dtypes(dtypes)
    records = []
    for library in _libraries(device):
        for dtype in dtypes:
            for n in sizes:
                a, b, out = _operands(library, device, (n, n), dtype, 3)
                if library == "numpy":
                    fn = lambda: np.matmul(a, b, out=out)  # noqa: E731
                else:
                    fn = lambda: torch.matmul(a, b, out=out)  # noqa: E731
                params = {"n": n, "flop_per_call": 2 * n**3, "library": library,
                          "torch_threads": torch.get_num_threads()}
                if device.is_cuda:
                    params["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
                m = measure(fn, device=device, warmup=1, repeats=repeats,
                            track_allocations=False, name=f"matmul n={n}")
                labels = dict(benchmark=BENCHMARK.name, case="matmul", library=library,
                              device=device.name, dtype=dtype, params=params)
                records += m.records(**labels)
                records += [make_record(**labels, metric="flop_rate", value=2 * n**3 / t,
                                        unit="FLOP/s", repeat=i) for i, t in enumerate(m.times_s)]
    return records


def copy_bandwidth(device="cpu", size_mib: int = 256, repeats: int = 5) -> list[dict]:
    """Bytes read + written per second copying one byte buffer into another of the same size."""
    import torch

    device = resolve_device(device)
    size_mib = _check_positive_ints("size_mib", [size_mib])[0]
    nbytes = size_mib * 2**20
    records = []
    for library in _libraries(device):
        if library == "numpy":
            src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
            fn = lambda: np.copyto(dst, src)  # noqa: E731
        else:
            src = torch.ones(nbytes, dtype=torch.uint8, device=device.torch)
            dst = torch.zeros(nbytes, dtype=torch.uint8, device=device.torch)
            fn = lambda: dst.copy_(src)  # noqa: E731
        m = measure(fn, device=device, warmup=1, repeats=repeats, track_allocations=False,
                    name=f"copy {size_mib} MiB")
        labels = dict(benchmark=BENCHMARK.name, case="copy", library=library, device=device.name,
                      dtype="uint8", params={"bytes": nbytes, "bytes_moved_per_call": 2 * nbytes,
                                             "library": library,
                                             "torch_threads": torch.get_num_threads()})
        records += m.records(**labels)
        records += [make_record(**labels, metric="bandwidth", value=2 * nbytes / t, unit="B/s",
                                repeat=i) for i, t in enumerate(m.times_s)]
    return records


def small_ops_workload(device, steps: int = 400, width: int = 64) -> Callable[[], object]:
    """A fixed GIL-bound workload: many small torch operations, like an eager gradient step."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(width, width, generator=gen) / width**0.5).to(device.torch)
    x0 = torch.randn(width, width, generator=gen).to(device.torch)

    def fn():
        x = x0
        for _ in range(steps):
            x = torch.tanh(x @ w) * 0.5 + x
        return x

    return fn


def numpy_temporaries_workload(steps: int = 100, size: int = 10_000) -> Callable[[], object]:
    """NumPy code that allocates a temporary per operation (80 kB float64 buffers)."""
    x0 = np.random.default_rng(0).standard_normal(size)

    def fn():
        x = x0
        for _ in range(steps):
            x = np.tanh(x) * 0.5 + x
        return x

    return fn


def torch_autograd_workload(device, steps: int = 20, width: int = 128) -> Callable[[], object]:
    """A small MLP's forward and backward under torch autograd (many tensor allocations)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(width, width, generator=gen) / width**0.5).to(device.torch)
               .requires_grad_() for _ in range(4)]
    x0 = torch.randn(64, width, generator=gen).to(device.torch)

    def fn():
        for _ in range(steps):
            x = x0
            for w in weights:
                x = torch.tanh(x @ w)
            loss = (x * x).sum()
            grads = torch.autograd.grad(loss, weights)
        return grads

    return fn


def _traced_time(fn: Callable[[], object], device: Device, python_allocators: bool = False) -> float:
    with AllocationTracker(device, python_allocators):
        return time_call(fn, device)


def _ratio_records(labels: dict, plain: list[float], instrumented: list[float],
                   params: dict) -> list[dict]:
    """Per-call times of both sides, the ratio of their medians (`time_ratio`) and of their
    minima (`time_ratio_min`: on a busy machine noise only adds time, so minima are steadier)."""
    rows = [make_record(**labels, metric="time_plain", value=t, unit="s", repeat=i, params=params)
            for i, t in enumerate(plain)]
    rows += [make_record(**labels, metric="time_instrumented", value=t, unit="s", repeat=i,
                         params=params) for i, t in enumerate(instrumented)]
    rows.append(make_record(**labels, metric="time_ratio", unit="ratio", params=params,
                            value=statistics.median(instrumented) / statistics.median(plain)))
    rows.append(make_record(**labels, metric="time_ratio_min", unit="ratio", params=params,
                            value=min(instrumented) / min(plain)))
    return rows


def _interleaved(variants: dict, rounds: int, seed: int = 0) -> dict:
    """Call every variant (a function returning one time) once per round, in a shuffled order,
    so that drift in machine speed and order effects hit every variant alike."""
    order = random.Random(seed)
    times = {key: [] for key in variants}
    for _ in range(rounds):
        keys = list(variants)
        order.shuffle(keys)
        for key in keys:
            times[key].append(variants[key]())
    return times


def _sample_time(device: Device, samples: int = 1000) -> float:
    """The sampler's own work per sample, without the thread switch that delivers it."""
    return statistics.median(measure_steps(lambda _: device.memory_in_use(), samples, device=device,
                                           track_peak=False).step_s)


def sampler_overhead(device="cpu", intervals_s=(0.001, 0.002, 0.01), rounds: int = 11,
                     steps: int = 400) -> list[dict]:
    """Time of the small-ops workload under `measure` with the timeline sampler on, divided by
    the time with it off, per sampling interval."""
    device = resolve_device(device)
    intervals = list(intervals_s)
    if not intervals or not all(isinstance(i, (int, float)) and i > 0 for i in intervals):
        raise Refused(f"intervals_s must be a non-empty list of positive seconds, "
                      f"got {intervals!r}")
    rounds = _check_positive_ints("rounds", [rounds])[0]
    fn = small_ops_workload(device, steps=steps)
    samples = {interval: 0 for interval in intervals}

    def plain() -> float:
        return measure(fn, device=device, warmup=0, repeats=1, track_allocations=False).times_s[0]

    def sampled(interval: float) -> Callable[[], float]:
        def run() -> float:
            m = measure(fn, device=device, warmup=0, repeats=1, track_allocations=False,
                        timeline=interval)
            samples[interval] += len(m.timeline)
            return m.times_s[0]
        return run

    with torch_threads(1):  # the pool's scheduling noise would swamp the instrument's cost
        fn()  # warm-up outside the comparison
        times = _interleaved({"off": plain, **{i: sampled(i) for i in intervals}}, rounds)
    labels = dict(benchmark=BENCHMARK.name, case="sampler_overhead", library="torch",
                  device=device.name, dtype="float32")
    records = [make_record(**labels, metric="sample_time", value=_sample_time(device), unit="s",
                           params={"what": "one memory_in_use() read, median of 1000"})]
    for interval in intervals:
        params = {"interval_s": interval, "workload": "torch small ops", "steps": steps,
                  "samples_per_call": samples[interval] / rounds, "torch_threads": 1}
        records += _ratio_records(labels, times["off"], times[interval], params)
    return records


def tracker_overhead(device="cpu", rounds: int = 11) -> list[dict]:
    """Time of NumPy and torch workloads inside memray's tracker divided by their plain time, with
    the system allocator traced (case `tracker_overhead`) and with Python's allocator traced too
    (`tracker_overhead_python`, CPU), all three interleaved; on CUDA also the torch workload on
    the GPU under the caching-allocator counters."""
    device = resolve_device(device)
    rounds = _check_positive_ints("rounds", [rounds])[0]
    cpu = resolve_device("cpu")
    workloads = [("numpy", "float64", "numpy temporaries", cpu, numpy_temporaries_workload()),
                 ("torch", "float32", "torch autograd MLP", cpu, torch_autograd_workload(cpu))]
    if device.is_cuda:
        workloads.append(("torch", "float32", "torch autograd MLP", device,
                          torch_autograd_workload(device)))
    records = []
    for engine, dtype, workload, where, fn in workloads:
        with torch_threads(1):  # the pool's scheduling noise would swamp the instrument's cost
            fn()  # warm-up outside the comparison
            variants = {"plain": lambda: time_call(fn, where), "traced": lambda: _traced_time(fn, where)}
            if not where.is_cuda:
                variants["traced_python"] = lambda: _traced_time(fn, where, python_allocators=True)
            times = _interleaved(variants, rounds)
            allocations = count_allocations(fn, where)
        params = {"workload": workload, "tracker": allocations.source,
                  "allocations_per_call": allocations.count, "torch_threads": 1}
        labels = dict(benchmark=BENCHMARK.name, library=engine, device=where.name, dtype=dtype)
        records += _ratio_records(labels | {"case": "tracker_overhead"}, times["plain"], times["traced"], params)
        if "traced_python" in times:
            params = params | {"tracker": f"{allocations.source} + Python allocators",
                               "python_allocations_per_call": allocations.python_count}
            records += _ratio_records(labels | {"case": "tracker_overhead_python"}, times["plain"],
                                      times["traced_python"], params)
    return records


def run_calibration(device="cpu", config: Config | None = None,
                    progress: Callable[[str], None] | None = print) -> list[dict]:
    """Every calibration on `device` at `config`'s sizes (this benchmark's Config; its defaults when
    None): a few seconds each on 2 cores."""
    device = resolve_device(device)
    cfg = config if config is not None else BENCHMARK.config()
    sizes = cfg["matmul_sizes_cuda" if device.is_cuda else "matmul_sizes_cpu"]
    steps = [
        ("matrix-product FLOP/s", lambda: matmul_flops(device, sizes, repeats=cfg["repeats"])),
        ("copy bandwidth", lambda: copy_bandwidth(device, cfg["copy_mib"], cfg["repeats"])),
        ("timeline sampler overhead",
         lambda: sampler_overhead(device, cfg["sampler_intervals_s"], cfg["rounds"])),
        ("allocation tracker overhead", lambda: tracker_overhead(device, cfg["rounds"])),
    ]
    records = []
    for label, step in steps:
        timed = measure_steps(lambda _: step(), 1, device=device, track_peak=False)
        records += timed.result
        if progress:
            progress(f"{label}: {timed.step_s[0]:.1f} s")
    return records


def headline_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Median of each headline metric per case, engine, dtype and parameters (a table)."""
    headline = {"flop_rate": ("GFLOP/s", 1e-9), "bandwidth": ("GB/s", 1e-9),
                "time_ratio": ("ratio", 1.0), "time_ratio_min": ("ratio", 1.0),
                "sample_time": ("μs", 1e6)}
    rows = frame[frame["metric"].isin(list(headline))]
    table = (rows.groupby(["case", "variant", "device", "dtype", "metric", "params"], sort=False)
             ["value"].median().reset_index())
    table["unit"] = [headline[m][0] for m in table["metric"]]
    table["value"] = [v * headline[m][1] for v, m in zip(table["value"], table["metric"])]
    table["setting"] = [_setting(json.loads(p)) for p in table["params"]]
    return pd.DataFrame(table[["case", "variant", "device", "dtype", "setting", "metric", "value",
                               "unit"]])


def _setting(params: dict) -> str:
    for key, fmt in (("n", "n={}"), ("bytes", "{} B"), ("interval_s", "interval {} s"),
                     ("workload", "{}")):
        if key in params:
            return fmt.format(params[key])
    return ""


def _memory(config, device) -> int:
    sizes = config.matmul_sizes_cuda if device.is_cuda else config.matmul_sizes_cpu
    return max(3 * max(sizes) ** 2 * np.dtype("float64").itemsize, 2 * config.copy_mib * 2**20)


BENCHMARK = Benchmark(
    name="calibration",
    yardstick=True,  # the machine's ceilings the others are read against: runs first, gives compare its drift
    question="What are this device's ceilings (matmul FLOP/s, copy bandwidth), and what do our instruments cost?",
    notebook="calibration.ipynb",
    cases="matrix-product FLOP/s and copy bandwidth per library and size, and what the timeline sampler and the "
          "allocation tracker add to a call",
    parameters=(
        Parameter("matmul_sizes_cpu", (128, 512, 1024), "square matrix sizes of the FLOP/s measurement on CPU",
                  quick=(64, 256), minimum=1),
        Parameter("matmul_sizes_cuda", (1024, 4096, 8192), "the same on CUDA", quick=(256, 1024), minimum=1),
        Parameter("copy_mib", 256, "MiB copied to measure bandwidth", quick=16, minimum=1),
        Parameter("sampler_intervals_s", (0.001, 0.002, 0.01), "timeline sampler intervals whose cost is measured",
                  quick=(0.002,), minimum=1e-6),
        Parameter("rounds", 11, "interleaved rounds of each overhead measurement", quick=3, minimum=1),
        Parameter("repeats", 5, "timed calls per size", quick=3, minimum=1),
    ),
    memory=_memory,
    headline=("flop_rate", "bandwidth", "time_ratio"),
    metrics=(
        ("flop_rate", "FLOP/s", "rate", "matrix-product floating-point operations per second"),
        ("bandwidth", "B/s", "rate", "bytes read plus written per second by a copy"),
        ("time_plain", "s", "time", "one call without the instrument under calibration"),
        ("time_instrumented", "s", "time", "one call with the instrument under calibration"),
        ("time_ratio", "ratio", "ratio", "median instrumented time / median plain time"),
        ("time_ratio_min", "ratio", "ratio", "fastest instrumented time / fastest plain time"),
        ("sample_time", "s", "time", "one memory read of the timeline sampler"),
    ),
    dimensions={"library": "an array library timed on its own (numpy, torch)",
                "tracker": "the allocation tracker measured on itself"},
    colors={"numpy": "#b8860b"},  # the library variant beside torch (an engine colour)
)
