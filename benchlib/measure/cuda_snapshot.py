"""The CUDA caching allocator's snapshot of one more call: every segment and block with the stack
that allocated it, in the pickle PyTorch's memory visualiser reads (https://pytorch.org/memory_viz,
or `python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html`). Written by the case's child
after its measured calls, so recording never shapes a measured number; nothing on the CPU.

The runner names the folder (`snapshot_folder`: the run's `CUDA_SNAPSHOT_FOLDER`), so the measuring code needs no run directory."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator

from .devices import Device

SNAPSHOT_ENTRIES = 100_000  # allocation events kept (torch's ring buffer): enough for a step, bounded in size
_FOLDER: ContextVar[Path | None] = ContextVar("benchlib_cuda_snapshot_folder", default=None)


@contextmanager
def snapshot_folder(folder: Path | None) -> Iterator[None]:
    """Within the block, isolated cases on CUDA write their allocator snapshot into `folder` (None: none)."""
    token = _FOLDER.set(folder)
    try:
        yield
    finally:
        _FOLDER.reset(token)


def snapshot_path(name: str, device: Device) -> str | None:
    """Where the case `name` writes its snapshot: None off CUDA or outside `snapshot_folder`."""
    folder = _FOLDER.get()
    if folder is None or not device.is_cuda:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / ("".join(c if c.isalnum() or c in "-_." else "-" for c in name) + ".pickle"))


def record_snapshot(fn: Callable[[], Any], device: Device, path: str) -> None:
    """One call of `fn` with the allocator's history recorded (Python stacks: C++ ones take minutes to
    symbolise), dumped to `path`."""
    import torch

    memory = torch.cuda.memory
    memory._record_memory_history(stacks="python", max_entries=SNAPSHOT_ENTRIES, device=device.index)
    try:
        fn()
        device.synchronize()
        memory._dump_snapshot(path)
    finally:
        memory._record_memory_history(enabled=None, device=device.index)
