"""Every engine's step of a model file, each trial in a fresh process, interleaved across engines.

Engines that cannot run the file's step are recorded as not applicable with the reason; a case
whose child fails (the user's code raised, a crash, a timeout) is recorded as failed with its
message and the other cases still run. Gradients are compared with eager torch's in the parent.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
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


def _applicability(model_file: ModelFile, values: dict) -> tuple[dict[str, str], dict[str, Any]]:
    """Per engine, why it does not apply; and the facts every record carries (dtype, what is checkpointed),
    from the model built once here at the run's values."""
    model, _ = model_file.build(values)
    first = next(model.parameters(), None)
    facts = {"dtype": str(first.dtype).removeprefix("torch.") if first is not None else "float32",
             "checkpoint": checkpoint_plan(model)}
    reasons = {engine: reason for engine in ENGINES
               if (reason := not_applicable(engine, model, model_file.optimizer is not None)) is not None}
    return reasons, facts


def measure_model_file(model_file: ModelFile, config: Config, device, progress: Callable[[str], None] = print) -> list[dict]:
    """The records of every engine's step at `config`'s values on `device`, `config.trials` fresh processes each."""
    from benchlib.measure import CaseFailed, IsolationOptions, run_isolated
    from benchlib.measure.allocations import memray_available
    from benchlib.results import make_record, status_record

    values = {name: config.plain()[name] for name in model_file.parameters}
    trials, name = config.trials, model_file.name
    base = {**values, "file": str(model_file.path), "trials": config.trials, "order_seed": ORDER_SEED,
            "warmup": WARMUP, "steps": STEPS}
    try:
        reasons, facts = _applicability(model_file, values)
    except Exception as error:  # the user's model does not build at these values: every case fails alike
        message = model_file.user_error(error, "model or batch (at the run's values)")
        return [status_record(status="failed", message=message, benchmark=name, case=CASE, device=device.name,
                              dtype="float32", params=base, engine=engine) for engine in ENGINES]
    labels = {engine: dict(benchmark=name, case=CASE, engine=engine, device=device.name, dtype=facts["dtype"])
              for engine in ENGINES}
    records = []

    def note(engine: str, status: str, message: str, params: dict) -> None:
        records.append(status_record(**labels[engine], status=status, message=message, params=params))
        progress(f"{name} {engine}: {status.replace('_', ' ')}: {message.splitlines()[0]}")

    for engine, reason in reasons.items():
        note(engine, "not_applicable", reason, base)
    runnable = [engine for engine in ENGINES if engine not in reasons]
    track = device.is_cuda or memray_available()
    failed, reference = set(), f"{REFERENCE} did not run, so there is no gradient to compare with"
    with tempfile.TemporaryDirectory(prefix="benchlib-usermodel-") as gradient_dir:
        for position, (trial, engine) in enumerate(trial_order(runnable, trials, ORDER_SEED, first=REFERENCE)):
            if engine in failed:
                continue
            params = {**base, "trial": trial, "position": position,
                      **({"checkpoint": facts["checkpoint"]} if engine == TORCH_CHECKPOINT else {})}
            try:
                result = run_isolated(TARGET, {"path": str(model_file.path), "engine": engine, "values": values,
                                               "gradient_dir": gradient_dir},
                                      name=f"{name}/{CASE}/{engine}", device=device.name,
                                      options=IsolationOptions(warmup=WARMUP, repeats=STEPS, track_allocations=track,
                                                               timeline=False))
            except CaseFailed as error:
                later = f" (its {trials - trial - 1} later trial(s) skipped)" if trial < trials - 1 else ""
                note(engine, "failed", f"trial {trial + 1} of {trials}: {error}{later}", params)
                failed.add(engine)
                if engine == REFERENCE:
                    reference = f"{REFERENCE} failed, so there is no gradient to compare with"
                continue
            checks = dict(result.checks)
            params.update({key: result.environment[key] for key in ("malloc_policy", "malloc_env")})
            if engine == REFERENCE:
                reference = None
            elif reference is None:
                checks[GRAD_ERROR_METRIC] = saved_gradient_error(gradient_dir, engine, REFERENCE)
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
