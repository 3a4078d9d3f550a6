"""Run a workload's case for every engine, each in a fresh process, and gather tidy records.

A workload provides a case target ("module:function", called in the child as
`function(device=..., engine=..., dtype=..., gradient_dir=..., **params)`) whose check saves the
gradient of the last measured call with `save_gradient(result, gradient_dir, engine)`.
`compare_engines` runs `manual` first, then every other engine, and compares each saved gradient
with manual's (`grad_max_rel_err`), so the check costs a file write instead of a second gradient.
It records every outcome (measured, failed with its error, or not applicable with the reason) and
keeps the memory timelines apart from the records (they are samples, not measured values), and
so the role timelines: one call per engine that exposes roles, in its first trial (its measured call
where the gauge is passive and the trial makes one; else one more call after them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import pandas as pd

from benchlib.errors import Failed, Refused
from benchlib.benchmark import Config, Parameter, distinct
from benchlib.engines import ENGINE_NAMES, case_imports, get_engine
from benchlib.engines.gradients import (GRAD_ERROR_METRIC, GRADIENT_TOLERANCE, WORST_ARRAY_METRIC, error_limit,
                                        gradient_tolerance)
from benchlib.records.metrics import GRADIENT_ROLE, SAVED_ROLE
from benchlib.trials.loop import GRAD_UNCHECKED_METRIC, TrialLoop, TrialSettings, Unit
from benchlib.analysis.engine_summary import REFERENCE_ENGINE, Problem, summarize
from benchlib.trials.stopping import Deadline

# Time is measured in the same calls as the memory timeline (one fresh process per case), so the
# sampler thread runs during the timed repeats (its cost is measured by the calibration notebook,
# see docs/measuring.md); the interval is recorded with every row.
TIMELINE_INTERVAL_S = 0.002
ROLE_TIMELINE_COLUMNS = ["case", "engine", "t_s", "bytes", "phase", SAVED_ROLE, GRADIENT_ROLE]
DTYPES = tuple(GRADIENT_TOLERANCE)  # the dtypes an engine comparison runs in (those with a gradient tolerance)
DATA_DTYPE = "data_dtype"  # in a lowering engine's params (autocast): the dtype of the data it was given


# How trials stop, for every benchmark that runs engines in fresh processes (`TrialStopping`).
PRECISION = Parameter("precision", 0.02, "an engine stops after 3 trials or more once its peak's 95% interval is "
                      "within this share of the median (or its trials are identical); 0 runs every trial",
                      minimum=0.0, maximum=1.0)


def trials_parameter(default: int, quick: int = 2) -> Parameter:
    """`trials` as a cap: at most this many fresh processes per engine, fewer once the peak settles."""
    return Parameter("trials", default, "at most this many fresh processes per engine, interleaved across engines "
                     "(fewer once the peak settles: see precision)", quick=quick, minimum=1)


def comparison_parameters(*, dtype: str, engines: Iterable[str], repeats: int, trials: int, warmup: int,
                          quick: Mapping[str, object] = (), valid_engines: Iterable[str] = ENGINE_NAMES,
                          malloc: str | None = None) -> tuple[Parameter, ...]:
    """The parameters every engine comparison declares (each engine in fresh processes, up to `trials`
    rounds interleaved, stopping at `precision`); `quick` gives their `--quick` values (trials default to
    2 there: an interval, barely);
    `malloc` the allocator policy by default (`DEFAULT_MALLOC_POLICY` unless given)."""
    from benchlib.measure.isolation import DEFAULT_MALLOC_POLICY, MALLOC_POLICIES

    quick = {"trials": 2, **dict(quick)}
    parameters = (
        Parameter("dtype", dtype, "floating-point type of the data and gradients", choices=DTYPES),
        Parameter("engines", tuple(engines), "gradient engines to compare, each in fresh processes",
                  choices=tuple(valid_engines)),
        Parameter("repeats", repeats, "timed calls per process (their median is kept)", minimum=1),
        trials_parameter(trials),
        PRECISION,
        Parameter("warmup", warmup, "untimed calls per process before the timed ones", minimum=0),
        Parameter("malloc", malloc or DEFAULT_MALLOC_POLICY, "glibc allocator policy of the child processes",
                  choices=tuple(MALLOC_POLICIES)),
    )
    return tuple(replace(p, quick=quick[p.name]) if p.name in quick else p for p in parameters)


def comparison_rules(config: Config) -> None:
    """What the comparison parameters' own bounds cannot say: an engine named twice."""
    if "engines" in config:
        distinct("engines", config.engines)


class GradientMismatch(AssertionError):
    """An engine's gradient disagrees with the hand-written one beyond its dtype's tolerance."""


class AllCasesFailed(Failed):
    """Not one case of a comparison could be measured: the notebook stops here, with the first
    case's error, instead of failing later in a table or figure with nothing to show."""


def validate_common(*, dtype: str, engines: Iterable[str], repeats: int, warmup: int, trials: int = 1) -> list[str]:
    """Refuse bad arguments before any child process starts, saying what is valid; the engines as a list
    (so a generator of names is read once)."""
    if dtype not in DTYPES:
        raise Refused(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(engines, str):
        raise Refused(f"engines must be a list of engine names, got the string {engines!r}")
    engines = list(engines)
    if not engines:
        raise Refused(f"engines must name at least one of {', '.join(ENGINE_NAMES)}")
    for name in engines:
        get_engine(name)
    if len(set(engines)) != len(engines):
        raise Refused(f"engines lists a name twice: {engines}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise Refused(f"repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise Refused(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise Refused(f"trials must be an integer >= 1 (fresh processes per engine), got {trials!r}")
    return engines


def planned_engines(engines: Iterable[str]) -> tuple[list[str], str | None]:
    """The engines a comparison runs: those asked for, with `manual` added first when missing, and the
    sentence saying so (None when nothing was added).

    Every ratio and every gradient check is to `manual` measured in the same run, never to a number
    from another run: a comparison without it could only fail (no baseline) or flatter (a weaker one).
    """
    engines = list(engines)
    if REFERENCE_ENGINE in engines:
        return engines, None
    return [REFERENCE_ENGINE, *engines], (
        f"{REFERENCE_ENGINE} added to the engines: it is the baseline of every ratio and the gradient every "
        "engine is checked against, measured in this run")


@dataclass
class EngineComparison:
    """What `compare_engines` gathered: tidy records, memory timelines, and the cases that did not run."""

    benchmark: str
    device: str
    dtype: str
    records: list[dict] = field(default_factory=list)
    timelines: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=["case", "engine", "t_s", "bytes", "phase"]))
    role_timelines: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ROLE_TIMELINE_COLUMNS))
    problems: list[Problem] = field(default_factory=list)
    case_params: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what planning changed (`planned_engines`), said with the table

    @property
    def ok(self) -> bool:
        """No case failed and every gradient is within tolerance (not-applicable cases are fine)."""
        return not any(p.status == "failed" for p in self.problems) and self.gradient_mismatches().empty

    def frame(self) -> pd.DataFrame:
        from benchlib.records import records_frame

        return records_frame(self.records)

    def summary_frame(self, params: Iterable[str] = ()) -> pd.DataFrame:
        """One row per case and engine: peak and median time, each with its ratio to `manual`
        (`analysis.engine_summary.summarize`). `params` names case parameters (e.g. "T") to add as columns, for sweeps.
        """
        table = summarize(self.frame(), self.problems, ENGINE_NAMES)
        for name in params:
            table.insert(1, name, table["case"].map(lambda case: self.case_params[case][name]))
        return table

    def gradient_mismatches(self) -> pd.DataFrame:
        """Cases whose gradient error exceeds the tolerance of their dtype (NaN counts as exceeding)."""
        frame = self.frame()
        errors = frame[frame["metric"].isin((GRAD_ERROR_METRIC, WORST_ARRAY_METRIC))]
        tolerance = pd.Series([error_limit(metric, dtype) for metric, dtype in zip(errors["metric"], errors["dtype"])],
                              index=errors.index, dtype="float64")  # a half-precision array lost: LOST_ARRAY
        bad = errors[~(errors["value"] <= tolerance)]
        return bad.assign(tolerance=tolerance[bad.index]).rename(columns={"variant": "engine"})[
            ["case", "engine", "dtype", "value", "tolerance"]]

    def check_gradients(self, raise_on_mismatch: bool = True) -> str:
        """Raise GradientMismatch, listing the offenders, when any gradient disagrees with `manual`; with
        `raise_on_mismatch=False` (the notebooks: the figures of the engines that agree still get drawn, and
        the runner reads the failed records as a partial run) list them first instead.

        Otherwise return one line per fact: how many gradients agree within which tolerance, and
        which engines could not be checked, with the reason (say, manual failed).
        """
        bad = self.gradient_mismatches()
        mismatch = (f"{self.benchmark}: gradients disagree with manual beyond tolerance ({GRAD_ERROR_METRIC} = "
                    f"max|g - g_manual| / max|g_manual|; {WORST_ARRAY_METRIC}: an array lost at half precision):\n"
                    f"{bad.to_string(index=False)}")
        if not bad.empty and raise_on_mismatch:
            raise GradientMismatch(mismatch)
        frame = self.frame()
        failed = set(zip(bad["case"], bad["engine"]))
        checked = frame[(frame["metric"] == GRAD_ERROR_METRIC)
                        & ~pd.Series(list(zip(frame["case"], frame["variant"])), index=frame.index).isin(failed)]
        lines = [mismatch] if not bad.empty else []
        lines += [f"{len(rows)} gradient(s) agree with manual within the {dtype} tolerance "
                  f"{gradient_tolerance(dtype):g} ({GRAD_ERROR_METRIC} up to {rows['value'].max():.2e})"
                  for dtype, rows in checked.groupby("dtype", sort=False)] or ["no gradient was compared with manual"]
        for row in frame[frame["metric"] == GRAD_UNCHECKED_METRIC].itertuples():
            lines.append(f"not checked: {row.variant} ({row.case}): {json.loads(row.params)['message']}")
        return "\n".join(lines)

    def timeline_frame(self) -> pd.DataFrame:
        """The memory timelines labelled with benchmark, device and dtype: the table a run saves."""
        return self.timelines.assign(benchmark=self.benchmark, device=self.device, dtype=self.dtype)[
            ["benchmark", "case", "engine", "device", "dtype", "t_s", "bytes", "phase"]]

    def role_timeline_frame(self) -> pd.DataFrame:
        """The role timelines (one call per engine that exposes roles, first trial), labelled
        like `timeline_frame`; a role an engine does not expose is NaN."""
        return self.role_timelines.assign(benchmark=self.benchmark, device=self.device, dtype=self.dtype)[
            ["benchmark", "device", "dtype", *ROLE_TIMELINE_COLUMNS]]

    def save(self, run) -> None:
        """Save into `run` (a `benchlib.records.Run`) the records and, as tables, both kinds of
        timeline: `<benchmark>_timelines` and `<benchmark>_role_timelines`."""
        run.save_records(self.records, self.benchmark)
        run.save_table(self.timeline_frame(), f"{self.benchmark}_timelines")
        run.save_table(self.role_timeline_frame(), f"{self.benchmark}_role_timelines")



@dataclass(frozen=True)
class Cases:
    """What a workload compares engines on: the child's target ("module:function"), each case's label
    and the params its child gets, and what only the parent needs (memory each engine needs, facts to
    record, engines that do not apply to this workload, engines fixed by the workload, and facts of
    one engine's set-up its records carry: `engine_params(engine, params)`, e.g. torch-checkpoint's
    segmentation)."""

    benchmark: str
    target: str
    params: Mapping[str, Mapping]
    memory_required: Callable[[str, Mapping], int | None] | None = None
    describe: Mapping | None = None
    not_applicable: Callable[[str], str | None] | None = None
    engines: tuple[str, ...] | None = None
    engine_params: Callable[[str, Mapping], Mapping] | None = None


def compare_engines(cases: Cases, settings: Mapping, *, device="auto", timeout_s: float = 600,
                    progress: Callable[[str], None] | None = print, deadline: Deadline | None = None,
                    results: Any = None, isolate: Callable | None = None) -> EngineComparison:
    """Run `cases.target` for every case and engine, each in a fresh process, up to `trials` times,
    through the one trial loop (`benchlib.trials.TrialLoop`).

    `settings` holds dtype, engines (unless `cases.engines` fixes them), repeats, trials, precision,
    warmup and malloc (the values of `comparison_parameters`, i.e. a benchmark's Config, or a plain mapping),
    and order_seed (default 0). `isolate` runs one child as `benchlib.measure.run_isolated` (the default) does.
    An engine stops before `trials` once its peak settles (`TrialStopping`: identical peaks, or the
    95% interval within `precision`, 0 or absent: never), or when `deadline` (default: the one
    `benchlib run --budget` set, if any) leaves no time for its next trial; the cases share the time
    left equally, and only the first child (the first case's reference) always runs. Interrupted (Ctrl-C,
    or the runner passing one on), it saves the records of every finished trial into `results` (a `Run`),
    when given, before the interrupt goes on. Each engine's `trials_run` record
    says how many trials it ran and why it stopped; one the deadline left unrun is a `not run` problem.

    The trials of a case are interleaved (`trial_order`: rounds of every engine, shuffled by
    `order_seed`), and each record's params carry `trial`, `trials`, `order_seed` and `position`
    (its place in the case's order), so intervals can be taken over trials and the order rebuilt.
    `manual` is added when not asked for (`planned_engines`: the baseline of every ratio, said in
    `notes` and by `progress`) and opens the first round; every other engine's saved gradient is
    compared with manual's (`grad_max_rel_err`) in every trial, or recorded as not checked
    (`grad_check_unavailable`, with the reason) when manual failed; one past its dtype's tolerance fails
    that engine (its measured rows kept, its later trials skipped, its summary row `failed`). A case that fails (exception, crash,
    timeout, or more memory than is available) becomes a `failed` record with its error and its
    later trials are skipped; an engine that cannot run on the device becomes a `not_applicable`
    record with the reason (so does one `cases.not_applicable(engine)` gives a reason
    for, e.g. `manual-seed` where the workload has no seed gradient). Neither stops the other
    cases. Only the first trial's memory timeline is kept (later trials sample too, so every
    trial is timed under the same instrument).
    `cases.describe` adds JSON-able facts to every record's params without passing them to the child.
    """
    from benchlib.measure import resolve_device, run_isolated
    from benchlib.measure.isolation import malloc_environment

    benchmark, dtype, malloc = cases.benchmark, settings["dtype"], settings.get("malloc")
    trials, precision = settings.get("trials", 1), settings.get("precision", 0.0)
    order_seed = settings.get("order_seed", 0)
    deadline = deadline or Deadline.from_environment()
    engines, added = planned_engines(validate_common(
        dtype=dtype, engines=cases.engines or settings["engines"], repeats=settings.get("repeats", 1),
        warmup=settings.get("warmup", 0), trials=trials))
    if malloc is not None:
        malloc_environment(malloc)  # an unknown policy is refused here, naming the valid ones
    device = resolve_device(device)
    comparison = EngineComparison(benchmark=benchmark, device=device.name, dtype=dtype, notes=[added] if added else [])
    if added and progress:
        progress(f"{benchmark}: {added}")
    loop = TrialLoop(TrialSettings(trials=trials, precision=precision, order_seed=order_seed,
                                   reference=REFERENCE_ENGINE), progress)
    timelines = _Timelines()
    measure = _measuring(cases, comparison, settings, device, (timeout_s, deadline), isolate or run_isolated)
    try:
        for index, (case, child_params) in enumerate(cases.params.items()):
            comparison.case_params[case] = dict(child_params)
            case_params = {**child_params, **(cases.describe or {}), "trials": trials, "precision": precision,
                           "order_seed": order_seed}
            units = _case_units(cases, loop, (case, child_params, case_params), engines, device, dtype)
            loop.run(units, measure, deadline=deadline.share(len(cases.params) - index), first_always_runs=index == 0,
                     keep=timelines.keep)
    except KeyboardInterrupt:  # in a trial or between cases: what finished is kept, then the interrupt goes on
        if results is not None and loop.records:
            results.save_records(loop.records, benchmark)
            if progress:
                progress(f"{benchmark}: interrupted; the {len(loop.records)} records of its finished trials "
                         f"are in {results.path}")
        raise
    return _gathered(comparison, loop, timelines)


def _measuring(cases: Cases, comparison: EngineComparison, settings: Mapping, device,
               limits: tuple[float, Deadline], isolate: Callable):
    """The trial loop's `measure(unit, trial, gradient_dir)`: one case of one engine in a fresh process (`isolate`),
    within its timeout, never past the deadline (`limits`; `Deadline.within`)."""
    from benchlib.measure import IsolationOptions

    dtype, malloc = settings["dtype"], settings.get("malloc")
    options = {} if malloc is None else {"malloc": malloc}
    timeout_s, deadline = limits

    def measure(unit: Unit, trial: int, gradient_dir: str):
        child_params = comparison.case_params[unit.labels["case"]]
        required = cases.memory_required(unit.engine, child_params) if cases.memory_required else None
        return deadline.within(lambda limit: isolate(
            cases.target, {**child_params, "engine": unit.engine, "dtype": dtype, "gradient_dir": gradient_dir},
            name=f"{cases.benchmark}/{unit.labels['case']}/{unit.engine}", device=device.name,
            options=IsolationOptions(warmup=settings.get("warmup", 0), repeats=settings.get("repeats", 1),
                                     track_allocations=False, timeline=True, timeout_s=limit,
                                     timeline_interval_s=TIMELINE_INTERVAL_S, role_timeline=trial == 0,
                                     memory_required_bytes=required, preload=case_imports(unit.engine, device),
                                     **options)), timeout_s)

    return measure


def _case_units(cases: Cases, loop: TrialLoop, of_case: tuple[str, dict, dict], engines: list[str], device,
                dtype: str) -> list[Unit]:
    """The units of one case (`of_case`: its name, the child's params and every record's), an engine each; one
    that cannot run here is noted in `loop` as not applicable."""
    case, child_params, case_params = of_case
    units = []
    for engine_name in engines:
        engine = get_engine(engine_name)
        own = cases.engine_params(engine_name, child_params) if cases.engine_params else {}
        unit = Unit(group=case, engine=engine_name, name=f"{cases.benchmark} {case}", params=case_params,
                    labels=dict(benchmark=cases.benchmark, case=case, engine=engine_name, device=device.name,
                                dtype=engine.computes_in(dtype)),
                    trial_params={**own, "timeline_interval_s": TIMELINE_INTERVAL_S,
                                  # a lowering engine's records carry the dtype it computes in; the data's:
                                  **({DATA_DTYPE: dtype} if engine.computes_in(dtype) != dtype else {})})
        reason = engine.not_applicable(device, dtype)
        if reason is None and cases.not_applicable is not None:
            reason = cases.not_applicable(engine_name)
        if reason is None:
            units.append(unit)
        else:
            loop.note(unit, "not applicable", reason)
    return units


class _Timelines:
    """The memory timelines of each case and engine's first trial, and its role timeline where it made one."""

    def __init__(self):
        self.memory: list[pd.DataFrame] = []
        self.roles: list[pd.DataFrame] = []

    def keep(self, unit: Unit, trial: int, result) -> None:
        labels = dict(case=unit.labels["case"], engine=unit.engine)
        if result.measurement.timeline is not None and trial == 0:
            self.memory.append(result.measurement.timeline.assign(**labels))
        if result.role_timeline is not None:
            self.roles.append(result.role_timeline.assign(**labels))


def _gathered(comparison: EngineComparison, loop: TrialLoop, timelines: _Timelines) -> EngineComparison:
    """The loop's records, problems and timelines in `comparison`; AllCasesFailed where nothing was measured."""
    comparison.records, comparison.problems = loop.records, loop.problems
    if timelines.memory:
        comparison.timelines = pd.concat(timelines.memory, ignore_index=True)[["case", "engine", "t_s", "bytes",
                                                                               "phase"]]
    if timelines.roles:
        comparison.role_timelines = pd.concat(timelines.roles, ignore_index=True).reindex(
            columns=ROLE_TIMELINE_COLUMNS)
    failed = [problem for problem in comparison.problems if problem.status == "failed"]
    if failed and not any(record["metric"] == "time" for record in comparison.records):
        first = failed[0]
        raise AllCasesFailed(f"{comparison.benchmark}: all {len(failed)} case(s) failed; the first, "
                             f"{first.engine} ({first.case}): {first.message}")
    return comparison
