"""A step traced under fake tensors: the model as a trace builds it (`usermodel.shapes.materialized`), the peak of
its live tensor bytes at any value of the parameter asked without its memory, by torch's own (private) `MemTracker`
(the CPU's answer; a GPU's replays the trace through the allocator: `fit.predicted`), and why a step could not be
traced, in one line."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def traced_peak(model_file, engine: str, values: Mapping[str, Any]) -> int:
    """The peak of live tensor bytes of one `engine` step at `values` (the optimizer's state made by a step
    before it, as in a measured process), traced under fake tensors. Raises where torch cannot trace the step
    (a batch that is not fake, data-dependent control flow, torch.func's wrappers). Arrays the file makes outside
    torch (numpy) are real: the trace model asks at most `TRACE_REACH[-1]` times the largest value measured,
    whose batch a measured process held in full."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from benchlib.usermodel.shapes import materialized

    def batch_is_fake(batch: tuple) -> None:
        real = [i for i, tensor in enumerate(batch) if not isinstance(tensor, FakeTensor)]
        if real:
            raise ValueError(f"batch() item(s) {real} are real tensors under fake tensor mode")

    with FakeTensorMode():
        return tracked_peak(model_file, engine, values, batch_is_fake, build=materialized)


def tracked_peak(model_file, engine: str, values: Mapping[str, Any], check_batch: Callable[[tuple], None] = tuple,
                 build: Callable = lambda make: make()) -> int:
    """The peak of live tensor bytes of one `engine` step at `values` by torch's `MemTracker`, after one step that
    makes the optimizer's state: under fake tensors (`traced_peak`) or, as a test compares, real ones."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchlib.usermodel.case import make_step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracker's own, about tensors it skips (None gradients)
        # on the CPU: moving fake parameters is refused; the bytes are the same
        model, batch = build(lambda: model_file.seeded_model(values)), model_file.seeded_batch(values)
        check_batch(batch)
        step = make_step(model_file, engine, values, model, batch)
        step()
        tracker = MemTracker()
        tracker.track_external(model, *step.optimizers)
        with tracker:
            step()
        (categories,) = tracker.get_tracker_snapshot("peak").values()
    return int(categories["Total"])


def untraced_reason(error: Exception) -> str:
    """Why a step could not be traced under fake tensors, in one line: the common case (the step asks a tensor for
    a Python number, which a fake tensor does not hold) in words, any other as torch said it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    first = re.sub(r"<([\w.]+) object at 0x[0-9a-f]+>", r"<\1>", first)  # an address says nothing to a reader
    said = f"{type(error).__name__}: {first if len(first) <= 240 else first[:240].rsplit(' ', 1)[0] + ' ...'}"
    if isinstance(error, DataDependentOutputException):
        return (f"the step reads a value out of a tensor (.item(), float(), a data-dependent shape), which a fake "
                f"tensor does not hold ({said})")
    return said
