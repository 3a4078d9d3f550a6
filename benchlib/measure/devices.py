"""Devices: where a measurement runs, how to synchronize it and how to read its memory.

torch is imported lazily so that CPU-only measurements (and the isolation child before its
case imports torch) do not pay for it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from contextlib import contextmanager
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from benchlib.errors import Refused
from benchlib.records.metrics import CUDA_ALLOC_RETRIES, CUDA_MALLOC_COUNT, CUDA_RESERVED_PEAK, CUDA_RESERVED_UNUSED

VALID_FORMS = '"auto", "cpu", "cuda", "cuda:N" (N a device index)'
_SPEC = re.compile(r"^(auto|cpu|cuda(?::(\d+))?)$")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@lru_cache(maxsize=1)
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def heap_trim_available() -> bool:
    """Whether this C library can hand freed heap back to the OS (glibc's ``malloc_trim``)."""
    return _malloc_trim() is not None


KEEP_HEAP_ENV = "BENCHLIB_KEEP_HEAP"  # set: a CPU peak is never reset, nor the freed heap handed back before it


def release_freed_heap() -> bool:
    """Hand the heap memory glibc keeps after ``free`` back to the OS (``malloc_trim(0)``), so
    process RSS follows live memory; False where the C library has no ``malloc_trim`` (not glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextmanager
def torch_threads(count: int):
    """Run the body with `count` torch intra-op threads, restoring the previous setting after: the
    thread pool's wake-ups shape short timings, so a measurement may need to fix the count."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise Refused(f"torch thread count must be an integer >= 1, got {count!r}")
    torch = _torch()
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class DeviceError(Refused):
    """A device request that is malformed or names hardware this machine does not have."""


def _torch():
    import torch

    return torch


def _built_without_gpu() -> bool:
    """Whether the installed torch is a build with neither CUDA nor ROCm, read from its `version.py` without
    importing torch (2-3 s of a process that only plans, as `benchlib run` does before its kernels start): such a
    build never sees a GPU. False where that cannot be told: torch is then asked."""
    if "torch" in sys.modules:
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return False
    return all(re.search(rf"^{backend}\b[^=\n]*= None$", text, re.M) for backend in ("cuda", "hip"))


def _cuda_count() -> int:
    if _built_without_gpu():
        return 0
    torch = _torch()
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _available() -> str:
    count = _cuda_count()
    if count == 0:
        torch = _torch()
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible")
        return f'available: "cpu" only ({why}; torch {torch.__version__})'
    return 'available: "cpu", ' + ", ".join(f'"cuda:{i}"' for i in range(count))


_statm = {"pid": None, "fd": None}


def _statm_fd() -> int | None:
    """An open descriptor on this process's statm: one pread per sample, no open/close.
    Reopened after a fork, since the inherited descriptor reads the parent's figures."""
    pid = os.getpid()
    if _statm["pid"] != pid:
        try:
            _statm["fd"] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        except OSError:
            _statm["fd"] = None
        _statm["pid"] = pid
    return _statm["fd"]


@lru_cache(maxsize=1)
def _psutil_process():
    import psutil

    return psutil.Process()


def process_rss() -> int:
    """Resident set size of this process in bytes (cheap: one pread of /proc/self/statm)."""
    fd = _statm_fd()
    if fd is not None:
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE_SIZE
    return _psutil_process().memory_info().rss


@lru_cache(maxsize=1)
def hwm_resettable() -> bool:
    """Whether the kernel lets us reset VmHWM (Linux >= 4.0, writable /proc/self/clear_refs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_vm_hwm() is not None
    except OSError:
        return False


def resident_high_water() -> int:
    """This process's resident high-water mark in bytes: VmHWM on Linux, which belongs to the process's own address
    space, not ru_maxrss, which keeps the high-water mark of whatever ran before the process's exec (a child started
    from a 1 GB parent reads 1 GB there: Linux folds the parent's mark into it); ru_maxrss elsewhere (KiB, bytes
    on macOS)."""
    if sys.platform.startswith("linux"):
        hwm = _read_vm_hwm()
        if hwm is not None:
            return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _read_vm_hwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def cuda_stat(index: int, stat: str, field: str) -> int:
    """One counter of the CUDA caching allocator, e.g. ("allocated_bytes", "current") is
    `torch.cuda.memory_allocated`. Read from the nested stats: `memory_stats()` flattens and sorts
    every counter in Python (136 µs for a dict of its shape on the project's CPU), too slow for a
    sampler that holds the GIL. 0 before CUDA is initialised, as torch reports it."""
    stats = _torch().cuda.memory_stats_as_nested_dict(index)
    return int(stats[stat]["all"][field]) if stats else 0


def _allocator_counters(index: int) -> dict[str, int]:
    """Cumulative counters of the caching allocator: segments it took from the driver (one cudaMalloc
    each) and the times it freed its cache and retried a failed cudaMalloc (fragmentation's symptom)."""
    stats = _torch().cuda.memory_stats_as_nested_dict(index)
    if not stats:
        return {CUDA_MALLOC_COUNT: 0, CUDA_ALLOC_RETRIES: 0}
    return {CUDA_MALLOC_COUNT: int(stats["segment"]["all"]["allocated"]),
            CUDA_ALLOC_RETRIES: int(stats.get("num_alloc_retries", 0))}


@dataclass(frozen=True)
class Device:
    """A resolved device; `name` is what records carry ("cpu", "cuda:0")."""

    kind: str
    index: int | None = None

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise DeviceError(f"unknown device kind {self.kind!r}; valid kinds: 'cpu', 'cuda'")
        if (self.kind == "cuda") != (self.index is not None):
            raise DeviceError("a cuda Device needs an index and a cpu Device must not have one")

    @property
    def name(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch(self):
        return _torch().device(self.name)

    def __str__(self) -> str:
        return self.name

    def synchronize(self) -> None:
        """Wait for queued device work, so that a clock read after it includes that work."""
        if self.is_cuda:
            _torch().cuda.synchronize(self.index)

    def memory_in_use(self) -> int:
        """Process RSS on CPU; bytes held by live tensors (`memory_allocated`) on CUDA."""
        if self.is_cuda:
            return cuda_stat(self.index, "allocated_bytes", "current")
        return process_rss()

    def reset_peak(self) -> None:
        """Restart peak tracking from the current level (VmHWM on Linux CPU).

        On CPU, glibc's freed-but-kept heap is handed back first: otherwise a warm-up call's
        freed buffers stay resident, count in the baseline, and the next call's small buffers
        reuse them unseen, so the peak above the baseline undercounts.
        """
        if self.is_cuda:
            _torch().cuda.reset_peak_memory_stats(self.index)
            return
        if os.environ.get(KEEP_HEAP_ENV):  # the "training-process" policy: the whole life's high-water mark
            return
        release_freed_heap()
        if hwm_resettable():
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak_memory(self) -> int | None:
        """Peak since `reset_peak`; None where the platform cannot reset a peak (not Linux)."""
        if self.is_cuda:
            return int(_torch().cuda.max_memory_allocated(self.index))
        if os.environ.get(KEEP_HEAP_ENV):  # never reset: the whole life's (asking `hwm_resettable` would reset it)
            return _read_vm_hwm() if sys.platform.startswith("linux") else None
        return _read_vm_hwm() if hwm_resettable() else None

    def allocator_counters(self) -> dict[str, int] | None:
        """The caching allocator's cumulative counters (CUDA; None on the CPU, which has no such allocator)."""
        return _allocator_counters(self.index) if self.is_cuda else None

    def allocator_view(self, before: dict[str, int] | None) -> dict[str, int] | None:
        """What the caching allocator did since `before` (`allocator_counters`, read after `reset_peak`):
        the reserved peak (absolute: what an out-of-memory error is about), reserved bytes holding no
        tensor at the peak (reserved peak minus allocated peak: the cache and its rounding, an upper
        bound where the two peaks fall apart in time), cudaMalloc calls and cache-flush retries.
        None on the CPU."""
        if not self.is_cuda or before is None:
            return None
        torch, after = _torch(), self.allocator_counters()
        reserved = int(torch.cuda.max_memory_reserved(self.index))
        return {CUDA_RESERVED_PEAK: reserved,
                CUDA_RESERVED_UNUSED: max(0, reserved - int(torch.cuda.max_memory_allocated(self.index))),
                **{name: after[name] - before[name] for name in (CUDA_MALLOC_COUNT, CUDA_ALLOC_RETRIES)}}

    def describe(self) -> dict:
        """What records and run metadata say about this device."""
        info: dict = {"device": self.name, "kind": self.kind, "index": self.index}
        if self.is_cuda:
            torch = _torch()
            props = torch.cuda.get_device_properties(self.index)
            info.update(gpu_name=props.name, total_memory_bytes=int(props.total_memory),
                        capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        else:
            info.update(cpu_count=os.cpu_count(), peak_source=(
                "VmHWM" if hwm_resettable() else "unavailable"))
        return info


def prime_cuda_libraries(device: Device) -> None:
    """On CUDA, one tiny matrix-product gradient (a plain product and one with a bias): cuBLAS creates
    its handle and workspace at the first product of each thread, the caller's and autograd's device
    thread that runs the backward pass, and takes the workspace from the caching allocator (32 MiB
    each on an H100 with torch 2.11). A warmed-up torch process has them; without this, a first
    measured call (``warmup=0``) counts them in its peak, which then says more of cuBLAS than of the
    code. Nothing on the CPU."""
    if not device.is_cuda:
        return
    torch = _torch()
    with torch.cuda.device(device.index):
        a = torch.ones(2, 2, device=device.torch, requires_grad=True)
        bias = torch.ones(2, device=device.torch, requires_grad=True)
        torch.autograd.grad((a @ a).sum() + torch.addmm(bias, a, a).sum(), (a, bias))
        torch.cuda.synchronize(device.index)


def cuda_without_gpu(spec: object) -> bool:
    """A well-formed CUDA request ("cuda", "cuda:N") on a machine without CUDA: what `benchlib fit` can
    predict but not measure."""
    match = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    return match is not None and match.group(1).startswith("cuda") and _cuda_count() == 0


def resolve_device(spec: str | Device = "auto") -> Device:
    """Turn "auto" | "cpu" | "cuda" | "cuda:N" into a Device; "auto" picks CUDA when present."""
    if isinstance(spec, Device):
        return spec
    if type(spec).__name__ == "device" and hasattr(spec, "type"):  # a torch.device
        spec = str(spec)
    if not isinstance(spec, str):
        raise DeviceError(f"device must be a string, got {type(spec).__name__}; "
                          f"valid forms: {VALID_FORMS}")
    match = _SPEC.match(spec.strip().lower())
    if match is None:
        raise DeviceError(f"malformed device {spec!r}; valid forms: {VALID_FORMS}")
    form, index = match.group(1), match.group(2)
    if form == "cpu":
        return Device("cpu")
    if form == "auto":
        return Device("cuda", _torch().cuda.current_device()) if _cuda_count() else Device("cpu")
    count = _cuda_count()
    if count == 0:
        raise DeviceError(f"device {spec!r} requested but CUDA is not available; {_available()}")
    if index is None:
        return Device("cuda", _torch().cuda.current_device())
    if int(index) >= count:
        raise DeviceError(f"device {spec!r} does not exist; {_available()}")
    return Device("cuda", int(index))
