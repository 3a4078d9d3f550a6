"""The child side of an isolated case: what a fresh interpreter (`python -m benchlib.measure.case_child
SPEC RESULT`) or a process forked from a warm template (`forkserver`) runs. It resolves the device,
sets the case up, measures it and writes the outcome as JSON; `isolation` is the parent's side.
Both sides import this module, and it imports neither, so there is no circle between them."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from importlib import import_module
from time import perf_counter
from typing import Any, Callable, ContextManager, Mapping

from benchlib.records.environment import allocator_env
from benchlib.records.store import write_json_atomic

from .core import SITES, measure_with_result
from .cuda_snapshot import record_snapshot
from .devices import Device, prime_cuda_libraries, resolve_device
from .timeline import MemoryTimeline, timeline_to_json


class NotApplicable(Exception):
    """Raised by a case's set-up or call when its engine cannot run this code at all (torch.func and an
    old-style autograd.Function, say): the parent records the case as not applicable, with this
    message, instead of failed. A bug in the user's code stays an ordinary exception: a failure."""


@dataclass(frozen=True)
class Case:
    """What a target returns: `fn()` is measured; `check(result_of_last_call)` -> {name: float};
    `roles()`, if given, a context manager whose value is a gauge, a callable giving the bytes
    the engine holds now by role (e.g. {"saved": ..., "gradients": ...}), for the role timeline;
    if the context manager has `metrics()`, what it returns after that call joins the checks; if it is
    `passive` (reading it changes nothing in the call), a trial of one measured call reads it there.
    `breakdown()`, if given, read after the check: rows {"metric", "value", "params"} that break a checked
    figure down (memory by module), each a record of its own with its params."""

    fn: Callable[[], Any]
    check: Callable[[Any], dict] | None = None
    roles: Callable[[], ContextManager[Callable[[], Mapping[str, int]]]] | None = None
    breakdown: Callable[[], list[dict]] | None = None



def _load_case(target: str, device: Device, params: dict) -> Case:
    module_name, func_name = target.split(":")
    func = getattr(import_module(module_name), func_name, None)
    if func is None:
        raise AttributeError(f"module {module_name!r} has no function {func_name!r}")
    case = func(device=device, **params)
    if not isinstance(case, Case):
        raise TypeError(f"{target} must return benchlib.measure.Case(fn, check=None), "
                        f"got {type(case).__name__}")
    return case


def _checks(case: Case, result: Any) -> dict[str, float]:
    if case.check is None:
        return {}
    checks = case.check(result)
    if not isinstance(checks, dict):
        raise TypeError(f"a case's check must return a dict of name -> float, "
                        f"got {type(checks).__name__}")
    return {str(k): float(v) for k, v in checks.items()}


def folded_roles(spec: dict, case: Case):
    """The role gauge's context when the measured call itself can carry it, else None: the trial makes exactly
    one measured call, sampled by a timeline, and the gauge is `passive` (benchlib's tape counters, kept
    anyway). The role timeline is then that call's, and no extra call is made. A gauge that hooks into the
    engine (torch's saved tensors) keeps its extra call after the measured ones, where its cost is no figure's."""
    if not (spec["role_timeline"] and case.roles is not None and spec["repeats"] == 1 and spec["timeline"]):
        return None
    context = case.roles()
    return context if getattr(context, "passive", False) else None


def _role_metrics(context) -> dict[str, float]:
    """What the gauge's context says of the calls made under it (`metrics()`, e.g. torch's saved bytes; {}
    without one), so a gauge that hooks into the engine is paid for once, not again by the check."""
    metrics = getattr(context, "metrics", None)
    return {} if metrics is None else {str(k): float(v) for k, v in metrics().items()}


def _role_timeline(case: Case, device: Device, interval_s: float):
    """One more call of the case, its memory sampled with the case's role gauge read alongside;
    the heap is handed back first, as before a measured call (`Device.reset_peak`), so the two
    timelines start from the same kind of baseline. Returns the frame and the role metrics."""
    device.reset_peak()
    context = case.roles()
    with context as gauge, MemoryTimeline(device, interval_s, gauge=gauge) as timeline:
        case.fn()
        device.synchronize()
    return timeline.frame(), _role_metrics(context)


def _environment(spec: dict, device: Device) -> dict:
    torch = sys.modules.get("torch")
    return {
        "pid": os.getpid(),
        "python": sys.executable,
        "malloc_policy": spec["malloc_policy"],
        "malloc_env": spec["malloc_env"],
        "allocator_env": allocator_env(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "device": device.describe(),
    }


PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # linux/prctl.h
CASE_PROCESS_NAME = "benchlib-case"  # what `ps` and psutil call a case's process, however it started


def name_process() -> None:
    """Name this process `CASE_PROCESS_NAME` (Linux), so a case's process can be told from its template."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, CASE_PROCESS_NAME.encode())


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a case never outlives
    the kernel or runner that started it and computes through the next notebook's measurements.
    If the parent is already gone (it died before this call), exit at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def _called(spec: dict, device: Device) -> dict:
    """The outcome of calling the spec's target with its params: its JSON value, or what it raised."""
    module_name, func_name = spec["target"].split(":")
    value = getattr(import_module(module_name), func_name)(device=device, **spec["params"])
    return {"ok": True, "value": value}


RSS_CAPPED_STATUS = 3  # the exit status of a child that passed its resident-memory cap (`IsolationOptions.rss_cap_bytes`)


def _watch_resident(cap: int, result_path: str) -> Callable[[], None]:
    """A thread that ends this process the moment its resident memory passes `cap`, leaving the outcome `capped`
    with the bytes it saw: a case asked at a value far past what fits must not take the machine down first.
    Returns what stops it: the cap judges the measured steps, not the check after them (a second model's gradient,
    memory by module), which would otherwise read as a step over the limit."""
    import threading
    import time

    page = os.sysconf("SC_PAGE_SIZE")
    stopped = threading.Event()

    def watch() -> None:
        with open("/proc/self/statm") as statm:
            while not stopped.is_set():
                statm.seek(0)
                resident = int(statm.read().split()[1]) * page
                if resident > cap:
                    write_json_atomic({"ok": False, "capped": resident, "cap": cap}, result_path)
                    os._exit(RSS_CAPPED_STATUS)
                time.sleep(0.005)

    if not os.path.exists("/proc/self/statm"):
        return lambda: None
    watcher = threading.Thread(target=watch, name="benchlib-resident-cap", daemon=True)
    watcher.start()

    def stop() -> None:
        stopped.set()
        watcher.join()

    return stop


def child_main(spec_path: str, result_path: str) -> int:
    """Run the case described in `spec_path`; write the outcome to `result_path` as JSON."""
    with open(spec_path) as f:
        spec = json.load(f)
    if "parent_pid" in spec:  # a spawned child; a forked one tied itself to its template already
        die_with_parent(spec["parent_pid"])
    name_process()
    sys.path.extend(p for p in spec["sys_path"] if p not in sys.path)
    try:
        device = resolve_device(spec["device"])
        if spec.get("call"):  # a call, not a case: the user's code run here rather than in the parent (`call_isolated`)
            outcome = _called(spec, device)
            write_json_atomic(outcome, result_path)
            return 0
        prime_cuda_libraries(device)  # cuBLAS's per-thread workspaces are no part of any case's peak
        stop_cap = _watch_resident(int(spec["rss_cap_bytes"]), result_path) if spec.get("rss_cap_bytes") else None
        started = perf_counter()
        case = _load_case(spec["target"], device, spec["params"])
        setup_s = perf_counter() - started
        folded = folded_roles(spec, case)
        with folded or nullcontext() as gauge:  # passive: only the timed calls' timeline reads it
            measurement, last = measure_with_result(
                case.fn, device=device, warmup=spec["warmup"], repeats=spec["repeats"],
                track_allocations=SITES if spec["track_allocations"] and spec["sites"] else spec["track_allocations"],
                timeline=spec["timeline"] and spec["timeline_interval_s"], attribute=spec.get("attribute", False),
                gauge=gauge)
        if stop_cap is not None:  # the steps held under the cap: what follows is no step
            stop_cap()
        phases, started = {"setup": setup_s, **measurement.phase_s}, perf_counter()
        checks = _checks(case, last)
        del last
        phases["check"], started = perf_counter() - started, perf_counter()
        roles = None
        if folded is not None:
            roles = timeline_to_json(measurement.timeline)
            checks.update(_role_metrics(folded))
        elif spec["role_timeline"] and case.roles is not None:
            frame, role_metrics = _role_timeline(case, device, spec["timeline_interval_s"])
            roles = timeline_to_json(frame)
            checks.update(role_metrics)
            phases["role_pass"], started = perf_counter() - started, perf_counter()
        if spec.get("cuda_snapshot") and device.is_cuda:  # last: recording shapes no measured number
            record_snapshot(case.fn, device, spec["cuda_snapshot"])
            phases["snapshot"] = perf_counter() - started
        measurement = dataclasses.replace(measurement, name=spec["name"], phase_s=phases)
        outcome = {"ok": True, "measurement": measurement.to_dict(), "checks": checks,
                   "breakdown": case.breakdown() if case.breakdown is not None else [],
                   "environment": _environment(spec, device), "role_timeline": roles}
    except NotApplicable as err:
        outcome = {"ok": False, "not_applicable": str(err)}
    except Exception as err:
        outcome = {"ok": False, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()}
    write_json_atomic(outcome, result_path)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchlib.measure.case_child SPEC_JSON RESULT_JSON")
    # Run the imported module's child_main, not this __main__ copy, so that the Case class a
    # target returns is the one isinstance() checks against.
    from benchlib.measure.case_child import child_main as _child_main

    _status = _child_main(sys.argv[1], sys.argv[2])
    # The result is written: exit now, without interpreter shutdown, so that threads the case
    # left running or a hang in library teardown cannot turn a finished case into a timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status)
