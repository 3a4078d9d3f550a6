"""torch's own view of a step's memory: torch.profiler's categories (parameter, optimizer state, input,
temporary, activation, gradient, autograd detail, unknown) at the moment torch's total is highest.

torch's profiler sorts every tensor it saw allocated by what the tensor was used as; benchlib's roles
(`benchlib.engines.roles`) are measured differently (parameters and optimizer state as held, gradients
and saved activations each at their own most), so the two are shown side by side and their
disagreement explained (docs/measuring.md). On CPU the profiler's memory timeline is read through
`export_memory_timeline`, which torch has deprecated in favour of CUDA-only snapshots: its warning is
silenced here, and a torch without it leaves the categories unmeasured, never guessed.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Callable

# export_memory_timeline's columns after its leading zero, in torch's order (_memory_profiler._CATEGORY_TO_INDEX)
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              "unknown")
METRIC = "torch_{}_bytes"  # one metric per category, and torch_peak_bytes for their sum at that moment


def torch_categories(fn: Callable[[], object], device: str = "cpu") -> dict[str, float]:
    """One call of `fn` under torch.profiler; `{torch_<category>_bytes: bytes}` at torch's peak, with
    `torch_peak_bytes`; empty when this torch cannot say."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as profiler:
        fn()
    with tempfile.TemporaryDirectory(prefix="benchlib-torch-memory-") as folder:
        path = os.path.join(folder, "timeline.json")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                profiler.export_memory_timeline(path, device=device)
            except (AttributeError, NotImplementedError):
                return {}
        with open(path) as file:
            _times, sizes = json.load(file)
    if not sizes:
        return {}
    at_peak = max(sizes, key=lambda row: sum(row[1:]))[1:]
    if len(at_peak) != len(CATEGORIES):
        return {}  # a torch whose columns are not these: unmeasured rather than mislabelled
    categories = {METRIC.format(name): float(size) for name, size in zip(CATEGORIES, at_peak)}
    return {**categories, METRIC.format("peak"): float(sum(at_peak))}
