"""Every engine's step of a model file, each trial in a fresh process, interleaved across engines.

Engines that cannot run the file's step are recorded as not applicable with the reason; a case
whose child fails (the user's code raised, a crash, a timeout) is recorded as failed with its
message and the other cases still run. Gradients are compared with the reference engine's (eager
torch) in the parent. A `Form` says what differs between the torch form and the array form.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchlib.benchmark import Config
from benchlib.engines.comparison import GRAD_UNCHECKED_METRIC, trial_order
from benchlib.engines.gradients import GRAD_ERROR_METRIC, gradient_file, saved_gradient_error
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


def _torch_plan(model_file: ModelFile, values: dict, device) -> Plan:
    model, _ = model_file.build(values)
    first = next(model.parameters(), None)
    reasons = {engine: reason for engine in ENGINES
               if (reason := not_applicable(engine, model, model_file.optimizer is not None)) is not None}
    return Plan(reasons, str(first.dtype).removeprefix("torch.") if first is not None else "float32",
                {TORCH_CHECKPOINT: {"checkpoint": checkpoint_plan(model)}})


TORCH_FORM = Form(TARGET, ENGINES, REFERENCE, _torch_plan)


def measure_model_file(model_file, form: Form, config: Config, device,
                       progress: Callable[[str], None] = print) -> list[dict]:
    """The records of every engine's step at `config`'s values on `device`, `config.trials` fresh processes each."""
    from benchlib.measure import CaseFailed, IsolationOptions, run_isolated
    from benchlib.measure.allocations import memray_available
    from benchlib.results import make_record, status_record

    values = {name: config.plain()[name] for name in model_file.parameters}
    trials, name = config.trials, model_file.name
    base = {**values, "file": str(model_file.path), "trials": config.trials, "order_seed": ORDER_SEED,
            "warmup": WARMUP, "steps": STEPS}
    engines, reference_engine = form.engines, form.reference
    try:
        plan = form.plan(model_file, values, device)
    except Exception as error:  # the user's code fails at these values: every case fails alike
        message = model_file.user_error(error, "building the case (at the run's values)")
        return [status_record(status="failed", message=message, benchmark=name, case=CASE, device=device.name,
                              dtype="float32", params=base, engine=engine) for engine in engines]
    labels = {engine: dict(benchmark=name, case=CASE, engine=engine, device=device.name, dtype=plan.dtype)
              for engine in engines}
    records = []

    def note(engine: str, status: str, message: str, params: dict) -> None:
        records.append(status_record(**labels[engine], status=status, message=message, params=params))
        progress(f"{name} {engine}: {status.replace('_', ' ')}: {message.splitlines()[0]}")

    for engine, reason in plan.reasons.items():
        note(engine, "not_applicable", reason, base)
    runnable = [engine for engine in engines if engine not in plan.reasons]
    track = device.is_cuda or memray_available()
    failed, reference = set(), f"{reference_engine} did not run, so there is no gradient to compare with"
    with tempfile.TemporaryDirectory(prefix="benchlib-usermodel-") as gradient_dir:
        for position, (trial, engine) in enumerate(trial_order(runnable, trials, ORDER_SEED, first=reference_engine)):
            if engine in failed:
                continue
            params = {**base, "trial": trial, "position": position, **plan.engine_params.get(engine, {})}
            try:
                result = run_isolated(form.target, {"path": str(model_file.path), "engine": engine, "values": values,
                                               "gradient_dir": gradient_dir},
                                      name=f"{name}/{CASE}/{engine}", device=device.name,
                                      options=IsolationOptions(warmup=WARMUP, repeats=STEPS, track_allocations=track,
                                                               timeline=False))
            except CaseFailed as error:
                later = f" (its {trials - trial - 1} later trial(s) skipped)" if trial < trials - 1 else ""
                note(engine, "failed", f"trial {trial + 1} of {trials}: {error}{later}", params)
                failed.add(engine)
                if engine == reference_engine:
                    reference = f"{reference_engine} failed, so there is no gradient to compare with"
                continue
            checks = dict(result.checks)
            params.update({key: result.environment[key] for key in ("malloc_policy", "malloc_env")})
            if engine == reference_engine:
                reference = None
            elif reference is None:
                checks[GRAD_ERROR_METRIC] = saved_gradient_error(gradient_dir, engine, reference_engine)
                gradient_file(gradient_dir, engine).unlink()
            else:
                records.append(make_record(**labels[engine], metric=GRAD_UNCHECKED_METRIC, value=1.0,
                                           params={**params, "message": reference}))
            records += result.measurement.records(**labels[engine], params=params)
            records += [make_record(**labels[engine], metric=metric, value=value, params=params)
                        for metric, value in checks.items()]
            progress(f"{name} {engine} trial {trial + 1}/{trials}: {result.measurement}"
                     + (f", {GRAD_ERROR_METRIC} {checks[GRAD_ERROR_METRIC]:.3g}" if GRAD_ERROR_METRIC in checks else ""))
    return records
