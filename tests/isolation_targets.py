"""Targets for tests/test_isolation.py: each is a `module:function` a child process imports."""
import contextlib
import os
import time

import numpy as np

from benchlib.measure import Case, mark

ARRAY_BYTES = 8 * 4_000_000


def allocate_in_check(device, n=4_000_000):
    """The measured call allocates little; its check allocates n float64s (a second model's gradient, say)."""
    return Case(lambda: np.ones(1000), lambda result: {"checked": float(np.ones(n).sum())})


def allocate(device, n=4_000_000):
    """Set-up allocates `kept` (before the baseline); the measured call allocates n float64s."""
    kept = np.ones(n)

    def fn():
        mark("allocate")
        out = np.ones(n)
        mark("reduce")
        return out

    def check(result):
        return {"sum": float(result.sum()), "kept": float(kept.size)}

    return Case(fn, check)


def with_roles(device, n=1_000_000):
    """A case with a role gauge: the measured call holds one array, which the gauge reports while
    the call runs (0 before and after)."""
    held = {"array": 0}

    def fn():
        out = np.ones(n)
        held["array"] = out.nbytes
        time.sleep(0.05)  # long enough for the sampler to see it
        held["array"] = 0
        return out

    return Case(fn, roles=lambda: contextlib.nullcontext(lambda: dict(held)))


class CountingRoles:
    """A role context that keeps a figure of the call it watched, as torch's saved-tensor hooks do."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self.calls += 1
        return lambda: {"array": 0}

    def __exit__(self, *exc):
        return None

    def metrics(self):
        return {"watched_calls": self.calls}


def with_role_metrics(device):
    return Case(lambda: None, lambda _: {"checked": 1.0}, roles=CountingRoles)


class PassiveRoles(CountingRoles):
    """A role context whose reading changes nothing in the call (as benchlib's tape counters): `passive`."""

    passive = True

    def __init__(self, held):
        super().__init__()
        self.held = held

    def __enter__(self):
        super().__enter__()
        return lambda: dict(self.held)


def with_passive_roles(device, n=1_000_000):
    """`with_roles`, its gauge passive; the call counts itself, so a test can tell how many calls were made."""
    held, calls = {"array": 0}, {"n": 0}

    def fn():
        calls["n"] += 1
        out = np.ones(n)
        held["array"] = out.nbytes
        time.sleep(0.05)
        held["array"] = 0
        return out

    return Case(fn, lambda _: {"calls": float(calls["n"])}, roles=lambda: PassiveRoles(held))


def raises(device):
    def fn():
        raise ValueError("deliberate failure in the measured function")

    return Case(fn)


def fails_in_setup(device, message="bad set-up"):
    raise RuntimeError(message)


def exits_hard(device, status=3):
    return Case(lambda: os._exit(status))


def aborts(device):
    return Case(os.abort)


def sleeps(device, seconds=60.0):
    return Case(lambda: time.sleep(seconds))


def not_a_case(device):
    return lambda: None


def environment(device):
    """Reports the child's view of its environment through the check."""
    def check(_):
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        return {"mmap_threshold": float(threshold) if threshold else -1.0,
                "pid": float(os.getpid())}

    return Case(lambda: None, check)


def cuda_allocate(device, n=1_000_000):
    import torch

    return Case(lambda: torch.ones(n, dtype=torch.float32, device=device.torch))


def cuda_matmul_gradient(device, n=64):
    """A first product's gradient on the GPU: its peak holds a few n x n buffers, not cuBLAS's workspaces."""
    import torch

    x = torch.ones(n, n, device=device.torch)
    w = torch.ones(n, n, device=device.torch, requires_grad=True)
    return Case(lambda: torch.autograd.grad((x @ w).sum(), w)[0])


def spawns_sleeper(device, seconds=60.0):
    """The measured call starts a grandchild and then hangs: a timeout must kill both."""
    import subprocess
    import sys

    def fn():
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
        with open(os.environ["GRANDCHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
        time.sleep(seconds)

    return Case(fn)


def leaves_thread_running(device):
    """The measured call starts a non-daemon thread that never ends, which would block a normal
    interpreter exit after the result is written."""
    import threading

    def fn():
        threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()
        return 1.0

    return Case(fn, lambda result: {"result": result})


def process_facts(device):
    """Reports, through the check, the child's pid, its parent's, its resident file-backed bytes (code and
    constants mapped from files) as set-up found them, whether it holds torch and is named as a case."""
    import sys

    with open("/proc/self/status") as status:
        file_kb = next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))
    with open("/proc/self/comm") as comm:
        named = comm.read().strip() == "benchlib-case"
    holds_torch = "torch" in sys.modules

    def check(_):
        return {"pid": float(os.getpid()), "ppid": float(os.getppid()), "rss_file_bytes": float(file_kb * 1024),
                "holds_torch": float(holds_torch), "named_as_case": float(named)}

    return Case(lambda: None, check)


def torch_process_facts(device):
    """`process_facts` once torch is imported, as a torch engine's set-up imports it."""
    import torch  # noqa: F401

    return process_facts(device)


def shared_pages() -> int:
    """Present pages of this process's private writable mappings it still shares with another (its template)."""
    import numpy as np

    count, pagemap = 0, os.open("/proc/self/pagemap", os.O_RDONLY)
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        if fields[1] == "rw-p":
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            entries = np.frombuffer(os.pread(pagemap, (end - start) // 4096 * 8, start // 4096 * 8), dtype=np.uint64)
            count += int(((entries >> np.uint64(63)) & ~(entries >> np.uint64(56)) & np.uint64(1)).sum())
    os.close(pagemap)
    return count


def dynamo_process_facts(device):
    """The pages it shares and its resident anonymous bytes once torch._dynamo is imported, as the set-up of a
    torch.func, checkpointed or optimized step imports it."""
    import torch._dynamo  # noqa: F401

    shared = shared_pages()
    with open("/proc/self/status") as status:
        anon_kb = next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))
    return Case(lambda: None, lambda _: {"shared_pages": float(shared), "rss_anon_bytes": float(anon_kb * 1024)})


def cuda_grow(device, n=1_000_000, count=4):
    """Tensors kept until the call returns, each larger than the last: the allocator takes new segments."""
    import torch

    return Case(lambda: [torch.ones(n * (i + 1), dtype=torch.float32, device=device.torch) for i in range(count)])
