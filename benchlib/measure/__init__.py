"""The instrument: devices, time, GC pauses, allocations, memory timelines, process isolation.

See docs/architecture.md for the contract and docs/measuring.md for how each quantity is
measured, what it costs and its caveats. Its names are imported from their modules when first asked for, so a
process that needs one part (a device, the isolation's options) loads none of the rest (pandas, torch).
"""

from benchlib.lazy_exports import lazy_exports

_HOMES = {
    "AllocationTracker": "allocations",
    "AllocationTrackingUnavailable": "allocations",
    "Allocations": "allocations",
    "Attribution": "allocations",
    "attribute_allocations": "allocations",
    "count_allocations": "allocations",
    "Measurement": "core",
    "StepTimes": "core",
    "measure": "core",
    "measure_steps": "core",
    "time_call": "core",
    "Device": "devices",
    "DeviceError": "devices",
    "resolve_device": "devices",
    "torch_threads": "devices",
    "GCMonitor": "gcmonitor",
    "GCPause": "gcmonitor",
    "tracked_objects": "gcmonitor",
    "Case": "case_child",
    "NotApplicable": "case_child",
    "DEFAULT_MALLOC_POLICY": "isolation",
    "MALLOC_POLICIES": "isolation",
    "CaseCapped": "isolation",
    "CaseFailed": "isolation",
    "CaseNotApplicable": "isolation",
    "IsolatedResult": "isolation",
    "IsolationOptions": "isolation",
    "MemoryRequirementError": "isolation",
    "prepare_isolation": "isolation",
    "run_isolated": "isolation",
    "RankedResult": "ranks",
    "rank_devices": "ranks",
    "run_ranks": "ranks",
    "MemoryTimeline": "timeline",
    "mark": "timeline",
}

__getattr__ = lazy_exports(__name__, _HOMES)

__all__ = sorted(_HOMES)
