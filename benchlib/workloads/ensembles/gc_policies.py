"""What the training loop does about Python's collector (GC policies), the long-lived heap, and what one
full collection over it costs."""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import torch

from benchlib.results import make_record
from benchlib.workloads.ensembles.config import BENCHMARK, GC_POLICIES


class GCPolicy:
    """What the loop does about Python's collector. All policies start from a full collection,
    so each run begins with the same heap state."""

    def __init__(self, name: str, *, every: int = 10, generation: int = 2, cuda: bool = False):
        if name not in GC_POLICIES:
            raise ValueError(f"unknown GC policy {name!r}; valid: {', '.join(GC_POLICIES)}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"manual GC interval must be a positive integer, got {every!r}")
        if generation not in (0, 1, 2):
            raise ValueError(f"manual GC generation must be 0, 1 or 2, got {generation!r}")
        self.name, self.every, self.generation, self.cuda = name, every, generation, cuda
        self._was_enabled = True

    def describe(self) -> dict:
        labels = {"gc_policy": self.name}
        if self.name == "manual":
            labels |= {"gc_every": self.every, "gc_generation": self.generation}
        return labels

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.collect()
        if self.name == "freeze":
            gc.freeze()
        elif self.name == "manual":
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Inside the timed step: the manual policy's explicit collection every K steps."""
        if self.name == "manual" and (step + 1) % self.every == 0:
            gc.collect(self.generation)
            if self.cuda:
                torch.cuda.empty_cache()

    def __exit__(self, *exc):
        if self.name == "freeze":
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        return False


@contextlib.contextmanager
def long_lived_heap(data, count: int):
    """Hold ``count`` samples as ``(tensor, label)`` tuples while the block runs (see
    `MNISTData.as_sample_tuples`); yields the list so it stays referenced."""
    heap = data.as_sample_tuples(count) if count else []
    try:
        yield heap
    finally:
        heap.clear()


def full_collection_pauses(data, heap_sizes=(0, 60000), repeats: int = 5):
    """Median pause of ``gc.collect()`` with ``heap_sizes`` samples held as tuples, with and
    without ``gc.freeze()``: what a full collection costs when it walks the long-lived heap.
    ``tracked_objects`` is how many objects that collection walks (``gc.get_objects()``, which
    leaves out the frozen ones)."""
    import pandas as pd

    from benchlib.measure import GCMonitor

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    rows = []
    for heap_size in heap_sizes:
        with long_lived_heap(data, heap_size):
            for frozen in (False, True):
                gc.collect()
                if frozen:
                    gc.freeze()
                tracked = len(gc.get_objects())
                try:
                    with GCMonitor() as monitor:
                        for _ in range(repeats):
                            gc.collect()
                finally:
                    if frozen:
                        gc.unfreeze()
                full = [duration for _, duration, generation in monitor.pauses if generation == 2]
                rows.append({"heap_objects": heap_size, "frozen": frozen, "tracked_objects": tracked,
                             "pause_s": float(np.median(full)),
                             "pause_max_s": float(np.max(full)), "repeats": repeats, "data": data.source})
    return pd.DataFrame(rows)


def collection_pause_records(pauses, device, labels: dict) -> list[dict]:
    """Tidy rows of `full_collection_pauses` (collector ``python-gc``)."""
    rows = []
    for row in pauses.itertuples():
        common = dict(benchmark=BENCHMARK, case=f"gc.collect|heap={row.heap_objects}|frozen={row.frozen}",
                      collector="python-gc", device=device, dtype="float32",
                      params=labels | {"heap_objects": row.heap_objects, "frozen": row.frozen, "repeats": row.repeats})
        rows.append(make_record(metric="full_gc_pause_median", value=row.pause_s, unit="s", **common))
        rows.append(make_record(metric="full_gc_pause_max", value=row.pause_max_s, unit="s", **common))
        rows.append(make_record(metric="tracked_objects", value=row.tracked_objects, unit="count", **common))
    return rows
