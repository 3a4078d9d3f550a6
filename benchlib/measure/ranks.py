"""One case on several torch.distributed ranks: a fresh interpreter per rank, all started at once.

Each rank is measured as `run_isolated` measures a case, in a process of its own with its own peak;
they meet through a file in a folder of this call's (`params["rendezvous"]`), so no port is chosen and
none can clash. Ranks wait on each other in every collective, so one that raises, exits or is killed
ends the step for all: its peers' collectives fail within moments (gloo sees the closed connection), and
whatever still runs `PEER_GRACE_S` later, or past the timeout, is killed. A rank that hangs is found the
other way round: its peers' collectives give up first (`COLLECTIVE_SHARE` of the time), and it is still
running. The failure names the rank that failed of its own accord first, and its own error. A template cannot fork ranks (it serves one case at a time), so each
imports torch itself; its threads are the machine's cores shared among the ranks.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from time import perf_counter

from benchlib.errors import Refused
from benchlib.records.metrics import RANK_PREFIX

from .devices import Device
from .isolation import (CaseCapped, CaseFailed, CaseNotApplicable, IsolatedResult, IsolationOptions, child_sys_path,
                        isolated_result, kill_group, measuring_spec, read_outcome, spawn_child)

PEER_GRACE_S = 15.0  # how long the other ranks may take to end once one has failed
POLL_S = 0.05
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "Socket Timeout", "Timed out waiting", "Watchdog caught collective operation timeout")  # what a
# collective says when another rank has gone or stopped answering
COLLECTIVE_SHARE = 0.8  # a collective waits this share of the process's time: a rank that hangs outside one is then
# still running when its peers' collectives give up, so it is the one named
SPAWN = "spawn"
RANK_FIGURES = ("role_parameter_bytes", "role_optimizer_bytes", "role_gradient_bytes", "role_saved_bytes",
                "role_gathered_bytes", "communication_share")  # a rank's checks kept per rank, beside its peak and time


@dataclass(frozen=True)
class RankedResult:
    """Every rank's result of one trial. The trial's own figures are its worst rank's (the most held at its peak,
    baseline and step together): a step on N devices fits where its worst rank fits; every rank's own figures are
    `rank_<metric>` rows of `breakdown`."""

    ranks: tuple[IsolatedResult, ...]

    @property
    def worst(self) -> int:
        return max(range(len(self.ranks)), key=lambda rank: held(self.ranks[rank].measurement))

    @property
    def measurement(self):
        return self.ranks[self.worst].measurement

    @property
    def checks(self) -> dict:
        """The worst rank's checks, with rank 0's judgement of the gathered gradient."""
        judged = {key: value for key, value in self.ranks[0].checks.items() if key.startswith("grad_")}
        return {**self.ranks[self.worst].checks, **judged}

    @property
    def environment(self) -> dict:
        return {**self.ranks[self.worst].environment, "worst_rank": self.worst}

    @property
    def breakdown(self) -> tuple:
        """The worst rank's memory by module, then every rank's own peak, time and roles (params: rank)."""
        rows = list(self.ranks[self.worst].breakdown)
        for rank, result in enumerate(self.ranks):
            figures = {"peak_bytes": result.measurement.peak_bytes, "baseline_bytes": result.measurement.baseline_bytes,
                       "time": result.measurement.median_s,
                       **{key: result.checks[key] for key in RANK_FIGURES if key in result.checks}}
            rows += [{"metric": f"{RANK_PREFIX}{metric}", "value": float(value), "params": {"rank": rank}}
                     for metric, value in figures.items() if value is not None]
        return tuple(rows)

    role_timeline = None


def held(measurement) -> int:
    """What a rank's process held at its step's peak: its baseline (model, optimizer state) and the step's peak."""
    return (measurement.baseline_bytes or 0) + (measurement.peak_bytes or 0)


def run_ranks(target: str, params: dict, *, name: str, world_size: int, devices: list[Device],
              options: IsolationOptions = IsolationOptions()) -> RankedResult:
    """`target(device=, group={rank, world_size, rendezvous, timeout_s}, **params)` measured on `world_size` ranks at
    once, rank r on `devices[r]`; CaseFailed naming the rank that failed first (the others are ended with it)."""
    if not (isinstance(world_size, int) and world_size >= 2 and len(devices) == world_size):
        raise Refused(f"world_size must be an int >= 2 with one device per rank, got {world_size!r} and "
                      f"{len(devices)} device(s)")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="benchlib-ranks-") as tmp:
        ranks = []
        for rank, device in enumerate(devices):
            rank_params = {**params, "group": {"rank": rank, "world_size": world_size,
                                               "timeout_s": options.timeout_s * COLLECTIVE_SHARE,
                                               "rendezvous": os.path.join(tmp, "rendezvous")}}
            spec, policy_env = measuring_spec(target, rank_params, f"{name} rank {rank}", device, options)
            folder = os.path.join(tmp, f"rank-{rank}")
            os.mkdir(folder)
            ranks.append((spec, policy_env, folder))
        started = perf_counter()
        ended = _run_all(ranks, threads, options.timeout_s)
        return _outcome(name, ranks, ended, options.timeout_s, started)


def _run_all(ranks: list, threads: int, timeout_s: float) -> list[tuple[int, bool, float]]:
    """Start every rank and wait: (exit code, timed out, when it ended) per rank. Once one fails, the others get
    `PEER_GRACE_S` to end; past the timeout every rank still running is killed."""
    processes, outputs = [], []
    try:
        for spec, policy_env, folder in ranks:
            with open(os.path.join(folder, "spec.json"), "w") as f:
                json.dump({**spec, "sys_path": child_sys_path(), "parent_pid": os.getpid()}, f)
            env = {**os.environ, **policy_env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
            outputs.append(open(os.path.join(folder, "output.txt"), "w"))
            processes.append(spawn_child(os.path.join(folder, "spec.json"), os.path.join(folder, "result.json"),
                                         outputs[-1], env))
        return _wait(processes, timeout_s)
    finally:  # also on Ctrl-C: nothing of any rank keeps running
        for process in processes:
            kill_group(process)
            process.wait()
        for output in outputs:
            output.close()


def _wait(processes: list, timeout_s: float) -> list[tuple[int, bool, float]]:
    start = time.monotonic()
    deadline = start + timeout_s
    ended: dict[int, tuple[int, bool, float]] = {}
    while len(ended) < len(processes):
        now = time.monotonic()
        for rank, process in enumerate(processes):
            if rank not in ended and process.poll() is not None:
                ended[rank] = (process.returncode, False, now - start)
        if any(code != 0 for code, _, _ in ended.values()):
            deadline = min(deadline, min(at for code, _, at in ended.values() if code != 0) + start + PEER_GRACE_S)
        if now > deadline:
            for rank, process in enumerate(processes):
                if rank not in ended:
                    kill_group(process)
                    process.wait()
                    ended[rank] = (process.returncode, True, now - start)
        time.sleep(POLL_S)
    return [ended[rank] for rank in range(len(processes))]


def _outcome(name: str, ranks: list, ended: list, timeout_s: float, started: float) -> RankedResult:
    """Every rank's result, or the failure of the rank that ended first among those that failed."""
    results, failures = [], []
    for rank, ((_, _, folder), (code, timed_out, at)) in enumerate(zip(ranks, ended)):
        try:
            result, _ = read_outcome(f"{name} rank {rank}", os.path.join(folder, "result.json"),
                                     os.path.join(folder, "output.txt"), code, timed_out and timeout_s)
            results.append(isolated_result(name, {**result, "isolation": SPAWN}, started))
        except CaseFailed as error:
            failures.append((timed_out, at, rank, error))
    if not failures:
        return RankedResult(tuple(results))
    capped = next((error for *_, error in failures if isinstance(error, CaseCapped)), None)
    if capped is not None:  # a rank past its memory cap: the step is over it, whatever the others said
        raise capped
    not_applicable = next((error for *_, error in failures if isinstance(error, CaseNotApplicable)), None)
    if not_applicable is not None:
        raise CaseNotApplicable(name, not_applicable.reason, output=not_applicable.output)
    # the first to fail of its own accord: not a collective that lost its peer, and not killed while it waited
    _, _, rank, first = min(failures, key=lambda failure: (_lost_peer(failure[3]), failure[0], failure[1]))
    others = [f"rank {other}: {_peer_words(error, rank)}" for _, _, other, error in sorted(failures) if other != rank]
    reason = f"rank {rank} of {len(ranks)} failed first: {first.reason}" + (
        f"; the other ranks ended with it ({'; '.join(others)})" if others else "")
    raise CaseFailed(name, reason, child_traceback=first.child_traceback, output=first.output)


def _lost_peer(error: CaseFailed) -> bool:
    """Whether a rank failed because a collective lost another rank (it closed, or stopped answering)."""
    text = f"{error.reason}\n{error.child_traceback}\n{error.output}"
    return any(sign in text for sign in PEER_LOST)


def _peer_words(error: CaseFailed, first: int) -> str:
    """How a rank that failed after `first` ended: its collective lost the failed rank, or its own first line."""
    return f"its collective lost rank {first}" if _lost_peer(error) else error.reason.splitlines()[0][:200]


def refuse_ranks_beyond_memory(world_size: int, per_rank_bytes: int, available_bytes: int | None = None) -> None:
    """ValueError, before any rank starts, where `world_size` processes of at least `per_rank_bytes` resident each
    (what the process that read the model file measured: torch imported, the model built at its QUICK values; a
    rank at the run's values holds more) cannot fit in the memory free now (`available_bytes`, psutil's by
    default): started anyway, they take the machine to its limit and end in the kernel's OOM killer."""
    from benchlib.units import format_bytes

    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    needed = world_size * per_rank_bytes
    if needed > available_bytes:
        fitting = max(1, available_bytes // per_rank_bytes)
        raise Refused(f"ranks={world_size} needs at least {format_bytes(needed)} ({world_size} processes of at "
                      f"least {format_bytes(per_rank_bytes)}: what the process that read the model file held, "
                      f"torch imported and the model built at its QUICK values), more than the "
                      f"{format_bytes(available_bytes)} free here; at most {fitting} such processes fit")


MOST_RANKS_A_CORE = 8  # past this, a run of ranks is refused: each step waits on the others for minutes


def refuse_crowded_cores(world_size: int, cores: int | None = None) -> None:
    """Refused, before any rank starts, where `world_size` ranks would share the cores more than `MOST_RANKS_A_CORE`
    a core: every step waits on the others (64 ranks on 2 cores ran for over 5 minutes at a load of 40), and its
    times measure the sharing. What each of many ranks holds is predicted from one simulated rank instead."""
    cores = cores or os.cpu_count() or 1
    if world_size > MOST_RANKS_A_CORE * cores:
        raise Refused(f"ranks={world_size} on {cores} core(s) is {world_size / cores:.0f} ranks a core: each rank's "
                      f"step would wait on the others' for minutes, and its times would measure the sharing; at most "
                      f"{MOST_RANKS_A_CORE * cores} ranks here ({MOST_RANKS_A_CORE} a core). What each of "
                      f"{world_size} ranks holds: `benchlib fit FILE --device cuda --ranks {world_size} --parallel "
                      f"fsdp ...` simulates rank 0 in one process")


def crowded_cores(world_size: int, cores: int | None = None) -> str | None:
    """What to say where `world_size` ranks share far fewer cores (more than two ranks a core): their times are
    the machine's sharing, not the step's. None otherwise."""
    cores = cores or os.cpu_count() or 1
    if world_size <= 2 * cores:
        return None
    return (f"ranks={world_size} share {cores} core(s): about {world_size / cores:.0f} ranks a core, so the step "
            f"times measure the machine's sharing more than the step (memory figures are unaffected)")


def rank_devices(device: Device, world_size: int) -> list[Device]:
    """The device of each rank: the host for every rank on the CPU, GPU r for rank r on CUDA (ValueError where
    there are fewer GPUs than ranks)."""
    from .devices import resolve_device

    if not device.is_cuda:
        return [device] * world_size
    import torch

    count = torch.cuda.device_count()
    if world_size > count:
        raise Refused(f"ranks={world_size} on CUDA needs a GPU per rank; this machine has {count}")
    return [resolve_device(f"cuda:{rank}") for rank in range(world_size)]
