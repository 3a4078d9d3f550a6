"""The instrument: devices, time, GC pauses, allocations, memory timelines, process isolation.

See docs/architecture.md for the contract and docs/measuring.md for how each quantity is
measured, what it costs and its caveats.
"""
from .allocations import (AllocationTracker, AllocationTrackingUnavailable, Allocations, Attribution,
                          attribute_allocations, count_allocations)
from .core import Measurement, StepTimes, measure, measure_steps, time_call
from .devices import Device, DeviceError, resolve_device, torch_threads
from .gcmonitor import GCMonitor, GCPause, tracked_objects
from .case_child import Case, NotApplicable
from .isolation import (DEFAULT_MALLOC_POLICY, MALLOC_POLICIES, CaseCapped, CaseFailed, CaseNotApplicable,
                        IsolatedResult, IsolationOptions, MemoryRequirementError, prepare_isolation,
                        run_isolated)
from .ranks import RankedResult, rank_devices, run_ranks
from .timeline import MemoryTimeline, mark

__all__ = [
    "AllocationTracker", "AllocationTrackingUnavailable", "Allocations", "Attribution", "Case", "CaseCapped", "CaseFailed", "CaseNotApplicable", "NotApplicable",
    "DEFAULT_MALLOC_POLICY", "Device", "DeviceError", "GCMonitor", "GCPause", "IsolatedResult", "IsolationOptions",
    "MALLOC_POLICIES", "Measurement", "MemoryRequirementError", "MemoryTimeline",
    "StepTimes", "attribute_allocations", "count_allocations", "mark", "tracked_objects", "measure", "measure_steps", "prepare_isolation", "rank_devices", "RankedResult", "resolve_device", "run_isolated", "run_ranks", "time_call", "torch_threads",
]
