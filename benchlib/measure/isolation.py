"""Run one case in a new process of its own, so that its memory figures start from a clean heap.

The parent writes a JSON spec, has a warm template fork the child (`forkserver`; with
`BENCHLIB_ISOLATION=spawn`, runs `python -m benchlib.measure.case_child SPEC RESULT` instead) and
reads the JSON result back (never pickle). The child resolves the device, imports the target
"module:function", calls it with `device=` and the params to set the case up, takes the baseline
after that set-up, measures, then runs the case's check on the last result. When asked, and when
the case offers a role gauge, a memory timeline reads the gauge at every sample: memory by role on
the allocator's clock. A passive gauge rides on a trial's single measured call; any other (or with
several measured calls) gets one more call after the measured ones.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from . import forkserver
from .core import Measurement, _check_counts
from .devices import Device, resolve_device
from .timeline import timeline_from_json

from benchlib.errors import Failed, Refused

MALLOC_POLICIES: dict[str, dict[str, str]] = {
    # Fixed mmap threshold: every buffer >= 128 KiB is its own mapping, returned to the OS when
    # freed, so RSS follows live memory instead of glibc's heap retention (docs/architecture.md).
    "mmap-128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    # The same down to 64 KiB: for workloads whose buffers are 64-128 KiB (the RNN's hidden states).
    # torch allocates them 64-byte aligned (posix_memalign), so once freed among small live objects a
    # heap hole cannot take the next one: the heap grows with every temporary and RSS counts
    # allocation volume, not live memory (docs/measuring.md).
    "mmap-64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    # The environment as inherited: glibc's dynamic threshold, for comparison.
    "glibc-default": {},
    # As a training process runs: glibc's defaults, and the heap the warm-up left kept (no trim, no peak reset
    # before the measured steps), so the peak is the process's whole-life resident high-water mark, what the OOM
    # killer or a cgroup limit meets (`benchlib fit`; `devices.KEEP_HEAP_ENV`).
    "training-process": {"BENCHLIB_KEEP_HEAP": "1"},
}
DEFAULT_MALLOC_POLICY = "mmap-128k"
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_TAIL_CHARS = 4000
# benchlib.measure imports this module before runpy runs it as __main__; harmless here.
_RUNPY_WARNING = "ignore:'benchlib.measure.case_child' found in sys.modules:RuntimeWarning"


@dataclass(frozen=True)
class IsolatedResult:
    name: str
    measurement: Measurement
    checks: dict
    environment: dict
    role_timeline: Any = None  # DataFrame of the role call (t_s, bytes, phase, one column per role) or None
    breakdown: tuple = ()  # the case's `breakdown()` rows: {"metric", "value", "params"} (memory by module)


class CaseFailed(Failed):
    """A case that did not produce a result: child exception, crash, timeout or refusal."""

    def __init__(self, name: str, reason: str, child_traceback: str = "", output: str = ""):
        self.name = name
        self.reason = reason
        self.child_traceback = child_traceback
        self.output = output
        message = f"case {name!r} failed: {reason}"
        if child_traceback:
            message += f"\n--- child traceback ---\n{child_traceback.rstrip()}"
        elif output:
            message += f"\n--- last child output ---\n{output.rstrip()}"
        super().__init__(message)


class CaseNotApplicable(CaseFailed):
    """The case's engine cannot run its code (the child raised `NotApplicable`): `reason` says why."""


class CaseCapped(CaseFailed):
    """The child passed its resident-memory cap (`IsolationOptions.rss_cap_bytes`) and ended itself: `resident` is
    what it held then, already more than the cap."""

    def __init__(self, name: str, resident: int, cap: int, output: str = ""):
        self.resident, self.cap = resident, cap
        super().__init__(name, f"its resident memory passed the {cap / 1e9:.3g} GB cap ({resident / 1e9:.3g} GB): "
                               "ended before it finished", output=output)


class MemoryRequirementError(CaseFailed):
    """The case declared more memory than the device has available; it was not started."""

    def __init__(self, name: str, required_bytes: int, available_bytes: int, device: str):
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes
        super().__init__(name, (
            f"needs {required_bytes:,} bytes ({required_bytes / 2**30:.2f} GiB) but only "
            f"{available_bytes:,} bytes ({available_bytes / 2**30:.2f} GiB) are available on "
            f"{device}; not started"))


def available_memory(device: Device) -> int:
    """Memory a new case could use: free device memory on CUDA, available RAM on CPU."""
    if device.is_cuda:
        import torch

        free, _total = torch.cuda.mem_get_info(device.index)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def malloc_environment(policy: str) -> dict[str, str]:
    """The environment variables a malloc policy sets; unknown policies are refused."""
    if policy not in MALLOC_POLICIES:
        raise Refused(f"unknown malloc policy {policy!r}; valid policies: "
                      f"{', '.join(repr(p) for p in MALLOC_POLICIES)}")
    return dict(MALLOC_POLICIES[policy])


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL_CHARS else "..." + text[-_TAIL_CHARS:]


def _crash_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        hint = " (often the kernel's out-of-memory killer)" if sig == "SIGKILL" else ""
        return f"the child process was killed by {sig}{hint} before writing a result"
    return f"the child process exited with status {returncode} without writing a result"


@dataclass(frozen=True)
class IsolationOptions:
    """How `run_isolated` measures a case, checked when made so a bad value is refused before any
    process starts. `malloc` names a MALLOC_POLICIES entry; `memory_required_bytes` (None: not
    checked) is compared with the device's available memory before the child starts."""

    warmup: int = 0
    repeats: int = 1
    track_allocations: bool = False
    timeline: bool = True
    timeline_interval_s: float = 0.002
    role_timeline: bool = False
    timeout_s: float = 600
    malloc: str = DEFAULT_MALLOC_POLICY
    memory_required_bytes: int | None = None
    sites: bool = False  # the allocation pass also groups the live allocations at its peak by line
    attribute: bool = False  # one more traced call after the others: allocation sites (Measurement.attribution)
    cuda_snapshot: str | None = None  # on CUDA, one more call with the allocator's history: its snapshot's path
    preload: tuple[str, ...] = ()  # modules the case's set-up imports anyway (torch for a torch engine): a fork
    # template holds them already (`forkserver`); a fresh interpreter imports them in set-up as before
    rss_cap_bytes: int | None = None  # the child ends itself once its resident memory passes this (`CaseCapped`)

    def __post_init__(self) -> None:
        _check_counts(self.warmup, self.repeats)
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if (self.timeline or self.role_timeline) and not (isinstance(self.timeline_interval_s, (int, float))
                                                          and self.timeline_interval_s > 0):
            raise ValueError(f"timeline_interval_s must be a positive number of seconds, "
                             f"got {self.timeline_interval_s!r}")
        if self.memory_required_bytes is not None and not (
                isinstance(self.memory_required_bytes, (int, float)) and self.memory_required_bytes >= 0):
            raise ValueError(f"memory_required_bytes must be a number of bytes >= 0 or None, "
                             f"got {self.memory_required_bytes!r}")
        if self.cuda_snapshot is not None and not (isinstance(self.cuda_snapshot, str) and self.cuda_snapshot):
            raise ValueError(f"cuda_snapshot must be a file path or None, got {self.cuda_snapshot!r}")
        if self.rss_cap_bytes is not None and not (isinstance(self.rss_cap_bytes, int) and self.rss_cap_bytes > 0):
            raise ValueError(f"rss_cap_bytes must be a number of bytes > 0 or None, got {self.rss_cap_bytes!r}")
        malloc_environment(self.malloc)  # an unknown policy is refused, naming the valid ones
        if not (isinstance(self.preload, tuple) and all(isinstance(m, str) and m for m in self.preload)):
            raise ValueError(f"preload must be a tuple of module names, got {self.preload!r}")


def _child_outcome(spec: dict, name: str, policy_env: dict, timeout_s: float, preload: tuple[str, ...]
                   ) -> tuple[dict, str]:
    """Run `spec` in a child of its own (`_run_child`) and read its outcome, with `isolation` (how it started) added;
    CaseFailed where it timed out, crashed or raised, CaseNotApplicable where it said so."""
    spec = {**spec, "sys_path": child_sys_path()}
    env = {**os.environ, **policy_env}
    with tempfile.TemporaryDirectory(prefix="benchlib-case-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        output_path = os.path.join(tmp, "output.txt")
        returncode, timed_out, isolation = _run_child(spec, spec_path, result_path, output_path, env, timeout_s, preload)
        result, output = read_outcome(name, result_path, output_path, returncode, timed_out and timeout_s)
    return {**result, "isolation": isolation}, output


def child_sys_path() -> list[str]:
    """The import path a case's child extends its own with: this process's folders."""
    return [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]


def read_outcome(name: str, result_path: str, output_path: str, returncode: int, timed_out: float | bool
                 ) -> tuple[dict, str]:
    """A finished child's result and the tail of its output; CaseFailed where it timed out (after `timed_out`
    seconds), crashed or raised, CaseCapped past its memory cap, CaseNotApplicable where it said so."""
    with open(output_path, errors="replace") as f:
        output = _tail(f.read())
    if timed_out:
        raise CaseFailed(name, f"timed out after {timed_out:g} s; the child was killed", output=output)
    if not os.path.exists(result_path):
        raise CaseFailed(name, _crash_reason(returncode), output=output)
    with open(result_path) as f:
        result = json.load(f)
    if not result["ok"] and "capped" in result:
        raise CaseCapped(name, int(result["capped"]), int(result["cap"]), output=output)
    if not result["ok"] and "not_applicable" in result:
        raise CaseNotApplicable(name, result["not_applicable"], output=output)
    if not result["ok"]:
        raise CaseFailed(name, f"the child raised {result['error']}", child_traceback=result["traceback"], output=output)
    return result, output


def call_isolated(target: str, params: dict, *, name: str, device: str | Device = "cpu", timeout_s: float = 600,
                  preload: tuple[str, ...] = ()) -> Any:
    """`target(device=Device, **params)` called in a process of its own, as a case runs (forked from a warm template,
    or a fresh interpreter), and its JSON value: the user's code (a model file read, traced) kept out of the
    caller's process. CaseFailed where it raised, timed out or took its process down; CaseNotApplicable where it
    raised NotApplicable."""
    dev = resolve_device(device)
    spec = {"target": target, "params": params, "name": name, "device": dev.name, "call": True}
    result, _ = _child_outcome(spec, name, {}, timeout_s, preload)
    return result["value"]


def run_isolated(target: str, params: dict | None = None, *, name: str, device: str | Device = "cpu",
                 options: IsolationOptions = IsolationOptions()) -> IsolatedResult:
    """Measure one case in a fresh `python` subprocess; failures raise CaseFailed(name).

    With `options.role_timeline`, a case that offers a role gauge has a call sampled at
    `options.timeline_interval_s` with its gauge (`IsolatedResult.role_timeline`): the measured call itself
    for a passive gauge and one measured call (`case_child.folded_roles`), else one more call after them."""
    spec, policy_env = measuring_spec(target, params, name, device, options)
    started = perf_counter()
    result, _ = _child_outcome(spec, name, policy_env, options.timeout_s, options.preload)
    return isolated_result(name, result, started)


def measuring_spec(target: str, params: dict | None, name: str, device: str | Device, options: IsolationOptions
                   ) -> tuple[dict, dict[str, str]]:
    """The spec a child measures `target(**params)` from, and the environment its malloc policy sets; a bad
    argument is refused here, before any process starts."""
    params = {} if params is None else params
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string naming the case, got {name!r}")
    if not isinstance(target, str) or not _TARGET.match(target):
        raise ValueError(f"target must be 'module:function' (e.g. 'benchlib.workloads.x:case'), "
                         f"got {target!r}")
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict of JSON values, got {type(params).__name__}")
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"params of case {name!r} must be JSON values (numbers, strings, "
                         f"lists, dicts): {err}") from err
    if not isinstance(options, IsolationOptions):
        raise TypeError(f"options must be an IsolationOptions, got {type(options).__name__}")
    policy_env = malloc_environment(options.malloc)
    dev = resolve_device(device)
    if options.memory_required_bytes is not None:
        available = available_memory(dev)
        if options.memory_required_bytes > available:
            raise MemoryRequirementError(name, int(options.memory_required_bytes), available, dev.name)
    spec = {"target": target, "params": params, "name": name, "device": dev.name,
            "warmup": options.warmup, "repeats": options.repeats, "track_allocations": options.track_allocations,
            "timeline": options.timeline, "timeline_interval_s": options.timeline_interval_s,
            "role_timeline": bool(options.role_timeline), "sites": bool(options.sites),
            "attribute": bool(options.attribute), "cuda_snapshot": options.cuda_snapshot,
            "malloc_policy": options.malloc, "malloc_env": policy_env, "rss_cap_bytes": options.rss_cap_bytes}
    return spec, policy_env


def isolated_result(name: str, result: dict, started: float) -> IsolatedResult:
    """A measuring child's result (JSON) as an IsolatedResult, its wall time since `started` less the child's own
    phases counted as the process's."""
    isolation = result.pop("isolation")
    measurement = Measurement.from_dict(result["measurement"])
    phases = dict(measurement.phase_s or {})  # the child's; the rest of the wall time is the process's own
    phases["process"] = max(0.0, perf_counter() - started - sum(phases.values()))
    roles = result["role_timeline"]
    return IsolatedResult(name=name, measurement=dataclasses.replace(measurement, phase_s=phases),
                          checks=result["checks"], environment={**result["environment"], "isolation": isolation},
                          role_timeline=None if roles is None else timeline_from_json(roles),
                          breakdown=tuple(result.get("breakdown", ())))


def prepare_isolation(options: IsolationOptions = IsolationOptions()) -> None:
    """Start the fork template that `run_isolated` with these options will fork from, without waiting: call it
    before work of your own (importing a model file, planning) so the template's imports run beside it. Does
    nothing where cases start fresh interpreters (`BENCHLIB_ISOLATION=spawn`)."""
    if forkserver.isolation_mode() == forkserver.FORK:
        policy_env = malloc_environment(options.malloc)
        forkserver.start_template({**os.environ, **policy_env}, _RUNPY_WARNING, options.preload)


def _run_child(spec: dict, spec_path: str, result_path: str, output_path: str, env: dict[str, str],
               timeout_s: float, preload: tuple[str, ...]) -> tuple[int, bool, str]:
    """Start the child and wait for it: forked from a warm template (`forkserver`), or a fresh
    interpreter when `BENCHLIB_ISOLATION=spawn` or no template can serve; (exit code, timed out, which)."""
    if forkserver.isolation_mode() == forkserver.FORK:
        with open(spec_path, "w") as f:
            json.dump(spec, f)  # the template's child ties itself to the template
        try:
            returncode, timed_out = forkserver.run_in_template(env, _RUNPY_WARNING, preload, spec_path, result_path,
                                                               output_path, spec["target"].split(":")[0], timeout_s)
            return returncode, timed_out, forkserver.FORK
        except forkserver.TemplateUnavailable as error:
            with open(output_path, "w") as f:
                f.write(f"[benchlib] no fork template ({error}); this case ran in a fresh interpreter\n")
    with open(spec_path, "w") as f:
        json.dump({**spec, "parent_pid": os.getpid()}, f)
    # Output goes to a file, not a pipe: a process the case leaves behind holding a pipe
    # open would otherwise keep us waiting after the child itself has finished.
    with open(output_path, "a") as output_file:
        proc = spawn_child(spec_path, result_path, output_file, env)
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on KeyboardInterrupt: nothing of the case keeps running
            kill_group(proc)
            proc.wait()
    return proc.returncode, timed_out, forkserver.SPAWN


def spawn_child(spec_path: str, result_path: str, output_file, env: dict[str, str]) -> subprocess.Popen:
    """A fresh interpreter running the spec (`case_child`), in a session of its own, its output into `output_file`."""
    return subprocess.Popen(
        [sys.executable, "-W", _RUNPY_WARNING, "-m", "benchlib.measure.case_child", spec_path, result_path],
        env=env, stdin=subprocess.DEVNULL, stdout=output_file, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the child's session: the child and anything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole session has exited already
    except AttributeError:  # no process groups (Windows): the child alone
        proc.kill()
