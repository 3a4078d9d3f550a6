"""What the runner does around each kernel: how it talks to it, what it passes down, what it
shows of it while it runs, and what it cleans up after it.

- Kernels are reached over IPC sockets in a private temporary directory, not TCP: nothing listens
  on a port, and ipykernel has no reason to warn that TCP traffic is unencrypted.
- Kernels start as benchlib's own processes do (`benchlib.runner.startup`), before the first cell.
- SIGTERM and SIGHUP (CI time-outs, job cancels, closed terminals) are turned into the same
  interrupt as Ctrl-C, so run.json is finished and marked `interrupted` rather than left `running`.
- The runner is the subreaper of its descendants (Linux): a process a dead kernel leaves behind is
  re-parented to the runner, which kills it before the next notebook starts.
- The notebook's own progress lines are printed as they come, with elapsed time and an ETA.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TextIO

from jupyter_client.manager import AsyncKernelManager
from traitlets import default

from benchlib.runner.startup import KERNEL_LINE

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def ipc_kernel_manager(socket_dir: str) -> type[AsyncKernelManager]:
    """A kernel manager class whose kernels listen on IPC sockets under `socket_dir`."""

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _default_transport(self) -> str:
            return "ipc"

        @default("ip")
        def _default_ip(self) -> str:
            return tempfile.mkdtemp(prefix="kernel-", dir=socket_dir) + "/socket"

        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            """The kernel's command, which first skips the imports benchlib's processes skip (runner.startup)."""
            return super().format_kernel_cmd([f"--IPKernelApp.exec_lines={KERNEL_LINE}", *(extra_arguments or [])])

    return IPCKernelManager


@contextmanager
def kernel_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables that kernels inherit, for the run only; the caller's own values win
    and everything is restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if saved[name] is None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux), so `reap_orphans` can find what a dead kernel left behind."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def reap_orphans(grace_s: float = 2.0) -> list[int]:
    """Terminate, then kill, every child process still alive after a notebook ended; their pids.

    Between notebooks the runner has no children of its own (the kernel has been shut down), so
    anything left is a process the kernel or its cases started and that would otherwise keep
    computing through the next notebook's measurements.
    """
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [child.pid for child in children]


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}:{seconds:02d}"


class ProgressLines:
    """A file-like sink for a notebook's stdout/stderr: each complete line is printed with the
    notebook's name, the time since it started and, when a previous duration is known, the time left."""

    def __init__(self, name: str, stream: TextIO, expected_s: float | None):
        self.name, self.stream, self.expected_s = name, stream, expected_s
        self.started = time.perf_counter()
        self._partial = ""

    def prefix(self) -> str:
        elapsed = time.perf_counter() - self.started
        eta = ""
        if self.expected_s:
            left = self.expected_s - elapsed
            eta = f", ~{_clock(left)} left" if left > 0 else ", over the last run's time"
        return f"    {self.name} {_clock(elapsed)}{eta} |"

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                print(f"{self.prefix()} {line.rstrip()}", file=self.stream, flush=True)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
