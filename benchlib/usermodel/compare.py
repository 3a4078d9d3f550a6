"""Every engine's step of a model file, each trial in a fresh process, interleaved across engines.

Engines that cannot run the file's step are recorded as not applicable with the reason; a case
whose child fails (the user's code raised, a crash, a timeout) is recorded as failed with its
message and the other cases still run. Gradients are compared with the reference engine's (eager
torch) in the parent. A `Form` says what differs between the torch form and the array form.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.benchmark import Config
from benchlib.engines import case_imports
from benchlib.engines.comparison import GRAD_UNCHECKED_METRIC, child_start_params, trial_order
from benchlib.engines.gradients import GRAD_ERROR_METRIC, gradient_file, saved_gradient_error
from benchlib.results.stopping import BUDGET, MAX_TRIALS, TRIALS_RUN, Deadline, TrialStopping
from benchlib.engine_names import TORCH_CHECKPOINT
from benchlib.usermodel.engines import ENGINES, REFERENCE, checkpoint_plan, not_applicable
from benchlib.usermodel.loader import ModelFile

TARGET = "benchlib.usermodel.case:case"
CASE = "step"
WARMUP = 1  # untimed steps per process: the optimizer's state exists before the baseline is read
STEPS = 5  # timed steps per process (their median is a trial's time)
ORDER_SEED = 0


@dataclass(frozen=True)
class Plan:
    """One run's facts, from the file's pieces built once in the parent at the run's values."""

    reasons: dict[str, str]  # engine -> why it does not apply
    dtype: str
    engine_params: dict[str, dict]  # engine -> extra params its records carry


@dataclass(frozen=True)
class Form:
    """What a model file's form gives the run: the child target, its engines (the reference runs
    first) and `plan(model_file, values, device) -> Plan`."""

    target: str
    engines: tuple[str, ...]
    reference: str
    plan: Callable[[Any, dict, Any], Plan]
    torch_categories: bool = False  # its child can add torch.profiler's categories (with `attribute`)


def _torch_plan(model_file: ModelFile, values: dict, device) -> Plan:
    model, _ = model_file.build(values)
    first = next(model.parameters(), None)
    reasons = {engine: reason for engine in ENGINES
               if (reason := not_applicable(engine, model, model_file.optimizer is not None)) is not None}
    return Plan(reasons, str(first.dtype).removeprefix("torch.") if first is not None else "float32",
                {TORCH_CHECKPOINT: {"checkpoint": checkpoint_plan(model)}})


TORCH_FORM = Form(TARGET, ENGINES, REFERENCE, _torch_plan, torch_categories=True)


def _trial_order(units: list[tuple[str, str]], trials: int, reference: str) -> list[tuple[int, tuple[str, str]]]:
    """(trial, (version, engine)) in the order the children run: every unit once per round, rounds
    shuffled, so drift falls on every version and engine alike; each version's reference opens the
    first round, so the other engines' gradients have one to be checked against."""
    keys = {f"{version}/{engine}": (version, engine) for version, engine in units}
    order = [(trial, keys[key]) for trial, key in trial_order(keys, trials, ORDER_SEED, first="")]
    first = sorted((item for item in order if item[0] == 0), key=lambda item: item[1][1] != reference)
    return first + [item for item in order if item[0] > 0]


def measure_model_files(versions: Mapping[str, Any], form: Form, config: Config, device,
                        progress: Callable[[str], None] = print) -> list[dict]:
    """The records of every version's engines at `config`'s values on `device`, `config.trials` fresh
    processes each, all interleaved. Every version is of one form, whose `Form` gives the engines, the
    reference and the child. One version is case `step`; several are one case each, named by version."""
    from benchlib.measure import CaseFailed, IsolationOptions, run_isolated
    from benchlib.measure.allocations import memray_available
    from benchlib.results import make_record, status_record

    first = next(iter(versions.values()))
    values = {name: config.plain()[name] for name in first.parameters}
    trials, name = config.trials, first.name
    engines, reference_engine = [engine for engine in form.engines if engine in config.engines], form.reference
    several = len(versions) > 1
    cases = {version: version if several else CASE for version in versions}
    shown = {version: f"{name} {version}" if several else name for version in versions}  # progress lines
    records: dict[str, list[dict]] = {version: [] for version in versions}
    base, labels, units, engine_params = {}, {}, [], {}

    def note(version: str, engine: str, status: str, message: str, params: dict) -> None:
        records[version].append(status_record(**labels[version, engine], status=status, message=message, params=params))
        progress(f"{shown[version]} {engine}: {status.replace('_', ' ')}: {message.splitlines()[0]}")

    for version, model_file in versions.items():
        base[version] = {**values, "file": str(model_file.path), **({"version": version} if several else {}),
                         "trials": trials, "order_seed": ORDER_SEED, "warmup": WARMUP, "steps": STEPS}
        status = "not_applicable"
        try:
            plan = form.plan(model_file, values, device)
        except Exception as error:  # the user's code fails at these values: every case fails alike
            message = model_file.user_error(error, "building the case (at the run's values)")
            status, plan = "failed", Plan(dict.fromkeys(engines, message), "float32", {})
        engine_params[version] = plan.engine_params
        for engine in engines:
            labels[version, engine] = dict(benchmark=name, case=cases[version], engine=engine, device=device.name,
                                           dtype=plan.dtype)
            if engine in plan.reasons:
                note(version, engine, status, plan.reasons[engine], base[version])
            else:
                units.append((version, engine))
    track = device.is_cuda or memray_available()
    attribute = bool(config.get("attribute", False))
    precision = float(config.get("precision", 0.0))
    stopping = TrialStopping(precision=precision, max_trials=trials, deadline=Deadline.from_environment())
    attributions: dict[tuple[str, str], dict] = {}
    failed, reference = set(), {version: f"{reference_engine} did not run, so there is no gradient to compare with"
                                for version in versions}
    with tempfile.TemporaryDirectory(prefix="benchlib-usermodel-") as gradients:
        folders = {version: Path(gradients) / str(index) for index, version in enumerate(versions)}
        for folder in folders.values():
            folder.mkdir()
        for position, (trial, (version, engine)) in enumerate(_trial_order(units, trials, reference_engine)):
            if (version, engine) in failed or (version, engine) in stopping.stopped:
                continue
            if position > 0 and not stopping.affords((version, engine)):  # the first child always runs
                continue
            model_file, gradient_dir = versions[version], folders[version]
            params = {**base[version], "trial": trial, "position": position,
                      **engine_params[version].get(engine, {})}
            traced = attribute and trial == 0  # the attribution passes: sites, and torch's categories
            started = stopping.now()
            try:
                result = run_isolated(form.target, {"path": str(model_file.path), "engine": engine, "values": values,
                                                    "gradient_dir": str(gradient_dir),
                                                    **({"categories": True} if traced and form.torch_categories else {})},
                                      name=f"{name}/{cases[version]}/{engine}", device=device.name,
                                      options=IsolationOptions(warmup=WARMUP, repeats=STEPS, track_allocations=track,
                                                               timeline=False, attribute=traced,
                                                               preload=case_imports(engine, device)))
            except CaseFailed as error:
                later = f" (its {trials - trial - 1} later trial(s) skipped)" if trial < trials - 1 else ""
                note(version, engine, "failed", f"trial {trial + 1} of {trials}: {error}{later}", params)
                failed.add((version, engine))
                if engine == reference_engine:
                    reference[version] = f"{reference_engine} failed, so there is no gradient to compare with"
                continue
            checks = dict(result.checks)
            params.update(child_start_params(result.environment))
            if engine == reference_engine:
                reference[version] = None
            elif reference[version] is None:
                checks[GRAD_ERROR_METRIC] = saved_gradient_error(gradient_dir, engine, reference_engine)
                gradient_file(gradient_dir, engine).unlink()
            else:
                records[version].append(make_record(**labels[version, engine], metric=GRAD_UNCHECKED_METRIC, value=1.0,
                                                    params={**params, "message": reference[version]}))
            records[version] += result.measurement.records(**labels[version, engine], params=params)
            if result.measurement.attribution is not None:
                attributions[version, engine] = result.measurement.attribution
            records[version] += [make_record(**labels[version, engine], metric=metric, value=value, params=params)
                                 for metric, value in checks.items()]
            progress(f"{shown[version]} {engine} trial {trial + 1}/{trials}: {result.measurement}"
                     + (f", {GRAD_ERROR_METRIC} {checks[GRAD_ERROR_METRIC]:.3g}" if GRAD_ERROR_METRIC in checks else ""))
            reason = stopping.add((version, engine), float(result.measurement.peak_bytes or 0),
                                  stopping.now() - started)
            if reason not in (None, MAX_TRIALS):
                progress(f"{shown[version]} {engine}: stopped after {trial + 1} trials ({reason})")
    for version, engine in units:
        if (version, engine) in failed:
            continue
        facts = stopping.summary((version, engine))
        count = facts.pop("trials_run")
        if count == 0:
            note(version, engine, "not_run", "the budget ran out before its first trial (benchlib run --budget)",
                 base[version])
            continue
        records[version].append(make_record(**labels[version, engine], metric=TRIALS_RUN, value=float(count),
                                            params={**base[version], **facts}))
        if facts["stop"] == BUDGET:
            progress(f"{shown[version]} {engine}: stopped after {count} trial(s) (budget)")
    for version, rows in site_diffs(attributions, labels, cases, reference_engine).items():
        records[version] += rows
    return [record for version in versions for record in records[version]]


def site_diffs(attributions: Mapping[tuple[str, str], dict], labels: Mapping[tuple[str, str], dict],
               cases: Mapping[str, str], reference: str) -> dict[str, list[dict]]:
    """Diff records (kind `diff`) of the attribution passes, per version: each engine's peak sites against
    the reference engine's (by line and function), and each later version's against the first version's
    under the same engine (by function and the innermost frame: the files and their lines differ)."""
    from benchlib.results.sites import diff_records, diff_sites, pass_sites

    out: dict[str, list[dict]] = {}
    versions = list(dict.fromkeys(version for version, _ in attributions))
    for (version, engine), attribution in attributions.items():
        rows = out.setdefault(version, [])
        if engine != reference and (version, reference) in attributions:
            diff = diff_sites(pass_sites(attributions[version, reference], "peak"), pass_sites(attribution, "peak"))
            rows += diff_records(diff, a=reference, b=engine, of="peak", **labels[version, engine])
        first = versions[0]
        if version != first and (first, engine) in attributions:
            diff = diff_sites(pass_sites(attributions[first, engine], "peak"), pass_sites(attribution, "peak"),
                              by=("function", "inner"))
            rows += diff_records(diff, a=cases[first], b=cases[version], of="peak", **labels[version, engine])
    return out


def measure_model_file(model_file, form: Form, config: Config, device,
                       progress: Callable[[str], None] = print) -> list[dict]:
    """One file's records: `measure_model_files` with it as the only version (case `step`)."""
    return measure_model_files({model_file.path.stem: model_file}, form, config, device, progress)
