"""Batch runs: validate everything, then execute notebooks through papermill into one run directory.

Each notebook gets `device` (resolved) and `results_dir` (the run directory) injected, writes its
records and figures through `benchlib.records.Run.open(results_dir)`, and is executed into
`<run>/notebooks/<name>.ipynb`. A failing notebook is recorded with its error and the rest run;
a notebook that ran to the end but whose cases partly failed (its workload saved `failed` status
records) is `partial`, never `ok`. run.json is rewritten (atomically) before and after every
notebook, so Ctrl-C, SIGTERM or SIGHUP lose nothing already written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TextIO

import pandas as pd

from benchlib.records import Run, default_results_root, load_records
from benchlib.trials.stopping import DEADLINE_ENV
from benchlib.report.figure_files import FIGURE_PNG_ENV, save_figure
from benchlib.records.places import now_iso
from benchlib.records.store import (
    RecordsKept,
    RecordsUnreadable,
    read_records_file,
    write_records_atomic,
)
from benchlib.runner.outcomes import (NotebookResult, RunResult, case_outcomes, last_duration,
                                      model_file_provenance)
from benchlib.runner.preflight import Execution, RunPlan, checked_plan, refuse_bad_options
from benchlib.runner.interrupts import Terminated, terminate_as_interrupt
from benchlib.runner.kernels import ProgressLines, become_subreaper, ipc_kernel_manager, reap_orphans
from benchlib.runner.papermill_exec import FAILED, TIMED_OUT, WarmKernel, execute_notebook
from benchlib.runner.sweep import (
    BENCHMARK_SLOT,
    dask_client,
    execute_remote,
    unpack_point,
)
from benchlib.registry import verdict_rules
from benchlib.runner.notebooks import DECLARED_NOTEBOOK, NotebookSpec, is_model_file

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a watchdog's wait must be a finite number the clock can take
# Kernels save each figure as plotly JSON *and* HTML (plotly.js once per notebook), so executed
# notebooks show their figures in nbconvert and repository previews, not only in Jupyter.
PORTABLE_FIGURES = {"PLOTLY_RENDERER": "plotly_mimetype+notebook"}
# Under --budget, each notebook stops measuring this share of its time (at most this many seconds) before
# its share ends: its kernel starts and its tables and figures are drawn in that time.
BUDGET_RESERVE_SHARE, BUDGET_RESERVE_S = 0.2, 20.0
# The generic notebook's first cell's imports, made as its kernel starts (`WarmKernel`).
WARM_IMPORTS = ("import benchlib.runner.declared, benchlib.usermodel.declare, plotly.graph_objects",)
# With --png, figures are also saved as PNG files and embedded as PNG in the executed notebooks.
PNG_FIGURES = {"PLOTLY_RENDERER": "plotly_mimetype+notebook+png", FIGURE_PNG_ENV: "1"}


@dataclass(frozen=True)
class RunOptions:
    """How `run` runs: one value, so that `run`'s keywords, the CLI and the loop that executes the
    notebooks share one list of options and defaults."""

    device: str = "auto"
    params: Mapping[str, Any] | None = None
    out: str | os.PathLike | None = None  # the results root; None: default_results_root()
    quick: bool = False
    notebooks_dir: str | os.PathLike | None = None
    progress: bool = True
    stream: TextIO | None = None  # None: sys.stdout
    command: Sequence[str] | None = None  # the command line, kept in run.json
    png: bool = False
    grid: Mapping[str, Sequence[Any]] | None = None
    executor: str = "local"
    scheduler: str | None = None
    attribute: bool = False  # one more traced pass per case: allocation sites (benchmarks that declare `attribute`)
    timeout_s: float | None = None  # the longest one notebook (one grid point) may run; None: no limit
    budget_s: float | None = None  # the whole run's time (--budget), shared among the notebooks; None: no budget

    @classmethod
    def of(cls, options: RunOptions | None, overrides: Mapping[str, Any]) -> RunOptions:
        """`options` (default: the defaults) with `overrides` by name; an unknown name is a TypeError."""
        names = [option.name for option in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"run() got unknown option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
        return replace(options or cls(), **overrides)


def _allocator_policy() -> str | None:
    from benchlib.measure import DEFAULT_MALLOC_POLICY

    return DEFAULT_MALLOC_POLICY


def _warm_kernel(names: Sequence[str], options: RunOptions):
    """A `WarmKernel` for a local run whose first notebook is the generic one (a model file: its check in a child
    takes seconds), started at once; else nothing. Not under --budget, whose deadline a kernel reads from its
    environment as the notebook starts."""
    if options.executor != "local" or options.budget_s is not None or not names or not is_model_file(names[0]):
        return contextlib.nullcontext()
    return WarmKernel(DECLARED_NOTEBOOK.parent, PNG_FIGURES if options.png else PORTABLE_FIGURES, WARM_IMPORTS)


def run(notebooks: Sequence[str] = (), *, options: RunOptions | None = None, **overrides: Any) -> RunResult:
    """Run `notebooks` (names or paths, default all) into a new run directory under `out` (default results/).

    The options are a `RunOptions` and/or its fields as keywords, which override it
    (`run(["probe"], device="cpu", quick=True)`). Everything is validated first (RunnerError /
    DeviceError, both ValueErrors): names, types and each workload's own value checks, memory
    included, for every grid point. Then each notebook (each grid point: `grid` maps a parameter to
    its values, see `benchlib.runner.sweep`) runs, here one at a time (`executor="local"`) or on a
    Dask cluster (`"dask"`, at `scheduler` or a local one). Failures are recorded, not raised. On
    KeyboardInterrupt, SIGTERM or SIGHUP the run is recorded as interrupted, the summary printed,
    and the interrupt re-raised. `progress` prints the notebooks' own output lines as they come,
    with elapsed time and an ETA.
    """
    options = RunOptions.of(options, overrides)
    stream = options.stream or sys.stdout
    root = Path(options.out) if options.out is not None else default_results_root()
    refuse_bad_options(options, MAX_TIMEOUT_S)
    with _warm_kernel(notebooks, options) as warm:  # started while the model files are checked
        plan = checked_plan(notebooks, options, root, stream)
        client, cluster = dask_client(options.scheduler) if options.executor == "dask" else (None, None)
        results_run = _created_run(root, plan, options)
        result = RunResult(results_run.run_id, results_run.path)
        injected = {"device": plan.device.name, "results_dir": str(results_run.path.resolve())}
        for execution in plan.executions:
            results_run.info["notebooks"][execution.key] = {
                "status": "not run", "parameters": _parameters(results_run, execution, injected),
                "path": str(execution.spec.path.resolve()), **({"grid": execution.point} if execution.point else {})}
        results_run.write_info()
        what = (f"{len(plan.executions)} grid point(s) of {len(plan.planned)} notebook(s)" if options.grid
                else f"{len(plan.planned)} notebook(s)")
        print(f"run {results_run.run_id}: {what} on {plan.device.name} -> {results_run.path}", file=stream, flush=True)
        become_subreaper()
        loop = _RunLoop(results_run, result, plan.executions, injected, root, replace(options, stream=stream), warm)
        try:
            with terminate_as_interrupt():
                if client is None:
                    loop.run_locally()
                else:
                    loop.run_on_dask(client)
        finally:
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
        if options.grid:
            _save_grid_figures(results_run)
        results_run.finish(interrupted=False, data_sources={r.name: r.data_source for r in result.notebooks if r.data_source})
        _conclude(results_run, result, plan.planned, stream)
        return result


def _created_run(root: Path, plan: RunPlan, options: RunOptions) -> Run:
    """The run directory and its run.json: the environment, what was asked and how it was planned."""
    notebooks_dir, grid, executor = options.notebooks_dir, options.grid, options.executor
    return Run.create(
        root,
        plan.device,
        allocator_policy=_allocator_policy(),
        device_requested=options.device,
        quick=options.quick,
        params=plan.typed_params,
        grid={name: list(values) for name, values in (grid or {}).items()},
        executor=executor if executor == "local" else f"dask ({options.scheduler or 'local cluster'})",
        notebooks_dir=str(Path(notebooks_dir).resolve()) if notebooks_dir is not None else None,
        benchmarks={spec.name: spec.benchmark.run_info() for spec, _ in plan.planned},
        model_files=model_file_provenance(plan.planned),
        command=list(options.command) if options.command is not None else None,
        attributed=plan.attributed,
        budget_s=options.budget_s,
        runner={"pid": os.getpid(), "host": socket.gethostname()},
    )


def _conclude(results_run: Run, result: RunResult, planned: Sequence[tuple[NotebookSpec, dict[str, Any]]],
              stream: TextIO) -> None:
    """After the notebooks: each benchmark's summary lines, the run's table, the seed verdicts, the noise
    table and the report (imported here: a refused run never loads scipy or the page builder)."""
    from benchlib.analysis.compare import noise_table, noise_text
    from benchlib.analysis.seed_verdicts import save_verdicts, seed_verdicts, verdict_text
    from benchlib.report.page import summary_lines, write_report
    from benchlib.report.tables.harness import harness_line

    for spec, _ in planned:  # the summary first: a benchmark's one line per variant, where its headline has them
        lines = summary_lines(results_run.path, spec.name)
        if lines:
            print("\n".join([f"{spec.name}:", *(f"  {line}" for line in lines)]), file=stream, flush=True)
    print(result.status_table(), file=stream, flush=True)
    records = load_records(results_run.path)
    verdicts = seed_verdicts(records, verdict_rules())
    save_verdicts(verdicts, results_run.path)
    print(verdict_text(verdicts, quick=bool(results_run.info.get("quick"))), file=stream, flush=True)
    cpu = results_run.info.get("environment", {}).get("cpu", {})
    noise = noise_table(records, load_average=cpu.get("load_average_1m_at_start"), cores=cpu.get("usable_cores"))
    results_run.save_table(noise, "noise")
    print(noise_text(noise), file=stream, flush=True)
    instrument = harness_line(records)
    if instrument:
        print(instrument, file=stream, flush=True)
    result.report = write_report(results_run.path)
    print(f"report: {result.report}", file=stream, flush=True)


def _parameters(results_run: Run, execution: Execution, injected: Mapping[str, str]) -> dict[str, Any]:
    """What papermill injects into one execution: its benchmark's values, device, and results_dir
    (a grid point writes into its own `points/<key>/`)."""
    if execution.point:
        injected = {**injected, "results_dir": str((results_run.path / "points" / execution.key).resolve())}
    return execution.spec.notebook_parameters(execution.values, injected)


class _RunLoop:
    """Executes the planned notebooks or grid points, records each outcome in run.json as it comes,
    and prints progress: the notebook's own lines locally, points done / total with an ETA."""

    def __init__(self, results_run: Run, result: RunResult, executions: Sequence[Execution], injected: Mapping[str, str],
                 root: Path, options: RunOptions, warm: WarmKernel | None = None):
        """`root` is the results root (the ETA reads past runs there); `options.stream` is written to; `warm`, a
        kernel already started for the first notebook, if it fits it."""
        self.run_, self.result, self.executions, self.injected = results_run, result, list(executions), injected
        self.warm = warm
        self.stream, self.root, self.quick, self.progress = options.stream, root, options.quick, options.progress
        self.figures_env = PNG_FIGURES if options.png else PORTABLE_FIGURES
        self.timeout_s = options.timeout_s
        self.budget_ends = None if options.budget_s is None else time.time() + options.budget_s
        self.durations: list[float] = []
        self.cut_by: dict[str, str] = {}  # per execution, the flag whose deadline it measured under

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _tally(self, index: int) -> str:
        total = len(self.executions)
        if total == 1:
            return "[1/1]"
        failed = sum(1 for r in self.result.notebooks if r.status in (FAILED, "partial", TIMED_OUT))
        done = {r.name for r in self.result.notebooks}
        left = [e for e in self.executions if e.key not in done]
        eta = ""
        if self.durations and left:  # each remaining one at its last run's time where known, else this run's mean
            mean = sum(self.durations) / len(self.durations)
            seconds = sum(last_duration(self.root, e.key, self.quick) or mean for e in left)
            if self.budget_ends is not None:  # the --budget ends the run sooner
                seconds = min(seconds, max(self.budget_ends - time.time(), 0.0))
            eta = f", ~{seconds:.0f} s left"
        return f"[{index}/{total}, {len(done)} done, {failed} failed{eta}]"

    def _interrupted(self, index: int, stopped: Sequence[Execution], duration: float, reason: str) -> None:
        """Finish the run as interrupted: `stopped` (running, or submitted and not back) marked
        `interrupted` in run.json, every execution not yet recorded `not run`, so none is left
        `running` or `submitted`."""
        reap_orphans()
        for execution in stopped:
            self.run_.info["notebooks"][execution.key].update(status="interrupted", duration_s=round(duration, 3),
                                                              ended_at=now_iso(), error=reason)
            parameters = _parameters(self.run_, execution, self.injected)
            self.result.notebooks.append(NotebookResult(execution.key, "interrupted", duration, parameters, reason))
        recorded = {r.name for r in self.result.notebooks}
        for execution in self.executions:
            if execution.key not in recorded:
                self.run_.info["notebooks"][execution.key].update(status="not run")
                self.result.notebooks.append(
                    NotebookResult(execution.key, "not run", 0.0, _parameters(self.run_, execution, self.injected)))
        self.result.interrupted = True
        self.run_.finish(interrupted=True, interrupted_by=reason)  # one write of run.json with every final state
        self.say(f"[{index}/{len(self.executions)}] {', '.join(e.key for e in stopped)}: interrupted ({reason})")
        self.say(self.result.status_table())
        from benchlib.report.page import write_report

        self.result.report = write_report(self.run_.path)
        self.say(f"report (partial run): {self.result.report}")

    def _finished(self, index: int, execution: Execution, status: str, error: str | None, duration: float,
                  since: float, orphans: Sequence[int] = (), in_points: bool = False) -> None:
        """Record one execution's outcome; `in_points`: its files are in `points/<key>/` (a grid point,
        or anything a Dask worker ran), whose records are merged into the run's."""
        in_points = in_points or bool(execution.point)
        point_dir = self.run_.path / "points" / execution.key
        outcomes = case_outcomes(point_dir if in_points else self.run_.path, since)
        failures, sources, not_run, benchmarks = outcomes.failures, outcomes.sources, outcomes.not_run, outcomes.benchmarks
        if status == "ok":
            status, error = outcomes.judged()
        cut_by = (self.cut_by.get(execution.key) or ("--budget" if self.budget_ends is not None else
                                                     "--timeout" if self.timeout_s else "time limit"))
        not_run_said = f"{not_run} case(s) not run: the {cut_by} left no time for them"
        if not_run and status == "ok" and cut_by == "--timeout":  # a safety limit asked nothing be left out:
            status, error = "partial", f"{not_run_said} (a longer --timeout runs them)"  # never `ok` without them
        if in_points:
            try:
                _merge_point_records(self.run_, execution, point_dir)
            except (RecordsUnreadable, RecordsKept) as lost:  # the point's own files stay in points/<key>/
                status, error = "failed", f"records not merged into the run: {lost}"
        output = self.run_.path / "notebooks" / f"{execution.key}.ipynb"
        data_source = "+".join(sources) or None
        self.run_.record_notebook(
            execution.key, status=status, duration_s=round(duration, 3), ended_at=now_iso(), error=error,
            failed_cases=failures, not_run_cases=not_run, data_source=data_source, orphans_killed=list(orphans),
            benchmarks=list(benchmarks),
            output=str(output.relative_to(self.run_.path)) if output.exists() else None)
        parameters = _parameters(self.run_, execution, self.injected)
        self.result.notebooks.append(NotebookResult(execution.key, status, duration, parameters, error,
                                                    output if output.exists() else None, data_source))
        self.durations.append(duration)
        detail = f" ({error.splitlines()[0][:200]})" if error else ""
        if not_run and not_run_said not in detail:
            detail += f" ({not_run_said})"
        self.say(f"{self._tally(index)} {execution.key}: {status} in {duration:.1f} s{detail}")

    def _measuring_deadline(self, index: int) -> tuple[float | None, str]:
        """When the execution at `index` (from 1) must stop measuring (`time.time()`), less a reserve for its
        kernel's start and its tables and figures: by its --timeout, and under --budget by its share of the time
        left, weighed by its last duration among those still to run (their mean where unknown). None without
        either; with the flag that sets it ("" for none). A case still running then fails as itself (`trials.cases`),
        before the kernel is ended."""
        timed = None
        if self.timeout_s:
            timed = time.time() + self.timeout_s - min(BUDGET_RESERVE_SHARE * self.timeout_s, BUDGET_RESERVE_S)
        if self.budget_ends is None:
            return timed, "--timeout" if timed is not None else ""
        now, rest = time.time(), self.executions[index - 1:]
        durations = [last_duration(self.root, execution.key, self.quick) for execution in rest]
        known = [duration for duration in durations if duration]
        weights = [duration or (sum(known) / len(known) if known else 1.0) for duration in durations]
        share = (self.budget_ends - now) * weights[0] / sum(weights)
        budgeted = now + share - min(BUDGET_RESERVE_SHARE * share, BUDGET_RESERVE_S)
        return (budgeted, "--budget") if timed is None or budgeted <= timed else (timed, "--timeout")

    def _budget_spent(self, index: int, execution: Execution) -> None:
        """Record an execution the budget left no time for as `not run`, saying so."""
        error = "not run: the --budget was spent before it started"
        self.run_.record_notebook(execution.key, status="not run", duration_s=0.0, ended_at=now_iso(), error=error)
        self.result.notebooks.append(NotebookResult(execution.key, "not run", 0.0,
                                                    _parameters(self.run_, execution, self.injected), error))
        self.say(f"[{index}/{len(self.executions)}] {execution.key}: {error}")

    def run_locally(self) -> None:
        with tempfile.TemporaryDirectory(prefix="benchlib-kernels-") as socket_dir:
            kernel_manager = ipc_kernel_manager(socket_dir)
            for index, execution in enumerate(self.executions, start=1):
                if self.budget_ends is not None and time.time() >= self.budget_ends:
                    self._budget_spent(index, execution)
                    continue
                parameters = _parameters(self.run_, execution, self.injected)
                output = self.run_.path / "notebooks" / f"{execution.key}.ipynb"
                output.parent.mkdir(exist_ok=True)
                shown = ", ".join(f"{key}={list(value) if isinstance(value, tuple) else value!r}" for key, value in execution.values.items())
                expected = last_duration(self.root, execution.key, self.quick)
                eta = f", last time {expected:.0f} s" if expected else ""
                deadline, self.cut_by[execution.key] = self._measuring_deadline(index)
                environment = dict(self.figures_env)
                if deadline is not None:
                    environment[DEADLINE_ENV] = repr(deadline)
                    measuring = max(deadline - time.time(), 0.0)
                    eta += f", measuring for at most {measuring:.0f} s of the {self.cut_by[execution.key]}"
                    expected = min(expected or math.inf, measuring + min(BUDGET_RESERVE_S, measuring))  # the ETA's basis
                self.say(f"[{index}/{len(self.executions)}] {execution.key}: started{f' ({shown})' if shown else ''}{eta}")
                self.run_.record_notebook(execution.key, status="running", started_at=now_iso())
                started, wall_start = time.perf_counter(), time.time()
                lines = ProgressLines(execution.spec.name, self.stream, expected) if self.progress else None
                try:  # a notebook's failure is a result to record; the others still run
                    warm = self.warm.take(execution.spec.path.parent, environment) if self.warm else None
                    status, error = execute_notebook(
                        execution.spec.path, output, parameters, cwd=execution.spec.path.parent,
                        kernel=warm or kernel_manager, kernel_env=environment, output_lines=lines,
                        timeout_s=self.timeout_s)
                except KeyboardInterrupt as interrupt:
                    reason = interrupt.signal_name if isinstance(interrupt, Terminated) else "KeyboardInterrupt"
                    self._interrupted(index, [execution], time.perf_counter() - started, reason)
                    raise
                duration = time.perf_counter() - started
                self._finished(index, execution, status, error, duration, wall_start, reap_orphans())

    def run_on_dask(self, client) -> None:
        """Submit every point (each needs the one benchmark slot of a worker) and record them as they come back."""
        from distributed import as_completed

        futures = {}
        for execution in self.executions:
            parameters = _parameters(self.run_, execution, self.injected)
            future = client.submit(execute_remote, execution.spec.path.read_text(encoding="utf-8"), execution.spec.name,
                                   parameters, str(execution.spec.path.parent), dict(self.figures_env), self.timeout_s,
                                   resources={BENCHMARK_SLOT: 1}, pure=False, key=f"benchlib-{self.run_.run_id}-{execution.key}")
            futures[future] = execution
            self.run_.record_notebook(execution.key, status="submitted", started_at=now_iso())
        self.say(f"submitted {len(futures)} point(s) to {client.scheduler.address}")
        try:
            for index, future in enumerate(as_completed(futures), start=1):
                execution = futures[future]
                point_dir = self.run_.path / "points" / execution.key  # never over the runner's own run.json
                output = self.run_.path / "notebooks" / f"{execution.key}.ipynb"
                try:
                    summary = unpack_point(future.result(), point_dir, output)
                    status, error, duration = summary["status"], summary["error"], summary["duration_s"]
                except Exception as lost:  # the worker died, or the point could not be run there
                    status, error, duration = "failed", f"{type(lost).__name__}: {lost}", 0.0
                self._finished(index, execution, status, error, duration, since=0.0, in_points=True)
        except KeyboardInterrupt as interrupt:
            for future in futures:
                future.cancel()
            reason = interrupt.signal_name if isinstance(interrupt, Terminated) else "KeyboardInterrupt"
            done = {r.name for r in self.result.notebooks}
            self._interrupted(len(done) + 1, [e for e in self.executions if e.key not in done], 0.0, reason)
            raise


def _merge_point_records(results_run: Run, execution: Execution, point_dir: Path) -> None:
    """An execution's records from `points/<key>/` into the run's `records/<key>.parquet`, a grid
    point's values added to params["grid"]."""
    parts = [read_records_file(path) for path in sorted((point_dir / "records").glob("*.parquet"))]
    if not parts:
        return
    frame = pd.concat(parts, ignore_index=True)
    if execution.point:
        frame["params"] = [json.dumps({**(json.loads(text) if text else {}), "grid": execution.point}, sort_keys=True,
                                      default=str) for text in frame["params"]]
    frame["run_id"] = results_run.run_id
    write_records_atomic(frame, results_run.path / "records" / f"{execution.key}.parquet")
    results_run.refresh_records(skip_unreadable=True)


def _save_grid_figures(results_run: Run) -> None:
    """One "metric against parameter" figure per benchmark and headline metric, from the merged records."""
    from benchlib.report.plots.sweep import GRID_METRICS, grid_figure

    records = results_run.load_records()
    if records.empty:
        return
    for benchmark in sorted(records["benchmark"].unique()):
        rows = records[records["benchmark"] == benchmark]
        for metric in GRID_METRICS:
            if (rows["metric"] == metric).any():
                save_figure(results_run, grid_figure(rows, metric=metric, grid=results_run.info.get("grid", {})),
                                        f"grid_{benchmark}_{metric}")
