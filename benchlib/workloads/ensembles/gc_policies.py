"""What the training loop does about Python's collector (GC policies), the long-lived heap, and what one
full collection over it costs."""

from __future__ import annotations

import contextlib
import gc

import torch

from benchlib.errors import Refused
from benchlib.records import make_record
from benchlib.workloads.ensembles.config import GC_POLICIES, RAISED_THRESHOLDS
from benchlib.workloads.ensembles.common import NAME


class GCPolicy:
    """What the loop does about Python's collector. All policies start from a full collection,
    so each run begins with the same heap state, and leave the collector as they found it."""

    def __init__(self, name: str, *, every: int = 10, generation: int = 2, cuda: bool = False):
        if name not in GC_POLICIES:
            raise Refused(f"unknown GC policy {name!r}; valid: {', '.join(GC_POLICIES)}")
        if not isinstance(every, int) or every < 1:
            raise Refused(f"manual GC interval must be a positive integer, got {every!r}")
        if generation not in (0, 1, 2):
            raise Refused(f"manual GC generation must be 0, 1 or 2, got {generation!r}")
        self.name, self.every, self.generation, self.cuda = name, every, generation, cuda
        self._was_enabled, self._thresholds = True, gc.get_threshold()  # what __enter__ finds, restored on exit

    def describe(self) -> dict:
        labels = {"gc_policy": self.name}
        if self.name == "manual":
            labels |= {"gc_every": self.every, "gc_generation": self.generation}
        if self.name == "thresholds":
            labels |= {"gc_thresholds": list(RAISED_THRESHOLDS)}
        return labels

    def __enter__(self):
        self._was_enabled, self._thresholds = gc.isenabled(), gc.get_threshold()
        gc.collect()
        if self.name == "freeze":
            gc.freeze()
        elif self.name == "thresholds":
            gc.set_threshold(*RAISED_THRESHOLDS)
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
        gc.set_threshold(*self._thresholds)
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
    """Every pause of ``repeats`` calls of ``gc.collect()`` with ``heap_sizes`` samples held as
    tuples, with and without ``gc.freeze()``: what a full collection costs against the objects it
    walks (``tracked_before``, counted by `GCMonitor` before each collection, frozen ones left
    out). One row per pause."""
    import pandas as pd

    from benchlib.measure import GCMonitor

    if not isinstance(repeats, int) or repeats < 1:
        raise Refused(f"repeats must be a positive integer, got {repeats!r}")
    frames = []
    for heap_size in heap_sizes:
        with long_lived_heap(data, heap_size):
            for frozen in (False, True):
                gc.collect()
                if frozen:
                    gc.freeze()
                try:
                    with GCMonitor(count_tracked=True) as monitor:
                        for _ in range(repeats):
                            gc.collect()
                finally:
                    if frozen:
                        gc.unfreeze()
                frames.append(pause_frame([p for p in monitor.pauses if p.generation == 2]).assign(
                    heap_objects=heap_size, frozen=frozen, data=data.source))
    return pd.concat(frames, ignore_index=True)


def pause_frame(pauses, steps=None):
    """One row per `GCPause` (`repeat` is its index; `step`, where given, the step it began in)."""
    import pandas as pd

    frame = pd.DataFrame([p._asdict() for p in pauses],
                         columns=["start_s", "duration_s", "generation", "collected", "uncollectable",
                                  "tracked_before", "count_s"]).rename(columns={"duration_s": "pause_s"})
    frame.insert(0, "repeat", range(len(frame)))
    if steps is not None:
        frame.insert(1, "step", list(steps))
    return frame.drop(columns=["start_s", "count_s"])


PAUSE_METRICS = {  # pause_frame column -> (metric, unit)
    "pause_s": ("gc_pause_time", "s"), "generation": ("gc_pause_generation", "count"),
    "collected": ("gc_pause_collected", "count"), "uncollectable": ("gc_pause_uncollectable", "count"),
    "tracked_before": ("gc_pause_tracked", "count"), "step": ("gc_pause_step", "count"),
}


def pause_records(pauses, **common) -> list[dict]:
    """Tidy rows of a `pause_frame`: one per pause and quantity, tied by `repeat` (the pause index);
    no `gc_pause_tracked` row where the objects walked were not counted (-1)."""
    return [make_record(metric=metric, value=float(getattr(row, column)), unit=unit, repeat=int(row.repeat), **common)
            for row in pauses.itertuples() for column, (metric, unit) in PAUSE_METRICS.items()
            if column in pauses.columns and not (column == "tracked_before" and row.tracked_before < 0)]


def collection_pause_records(pauses, device, labels: dict) -> list[dict]:
    """Tidy rows of `full_collection_pauses` (collector ``python-gc``), one case per heap and freeze state."""
    rows = []
    for (heap_size, frozen), group in pauses.groupby(["heap_objects", "frozen"], sort=False):
        rows += pause_records(group, benchmark=NAME,
                              case=f"gc.collect|heap={heap_size}|frozen={frozen}", collector="python-gc",
                              device=device, dtype="float32",
                              params=labels | {"heap_objects": int(heap_size), "frozen": bool(frozen)})
    return rows
