"""The one trial loop: every engine of a comparison in fresh processes, interleaved, stopped by `TrialStopping`.

Engine comparisons of the built-in benchmarks and a model file's engines (one version or several)
run through `TrialLoop`: the order (rounds of every unit, shuffled by a seed, each group's reference
first), a deadline that skips what it cannot afford (the first child always runs, so there is a
baseline), a failure that skips the unit's later trials, each gradient checked against the group's
reference, and the records that say what happened (`trials_run`, `failed`, `not run`,
`not applicable`). The caller says how one trial is measured (`measure`) and keeps what only it needs
(timelines, attributions) through `keep`.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from benchlib.engines.gradients import (GRAD_ERROR_METRIC, LOST_ARRAY, SEED_DEPENDENT_METRIC,
                                        UPDATE_ERROR_METRIC, WORST_ARRAY_METRIC, array_floor, error_limit,
                                        gradient_file, gradient_tolerance, saved_gradient_error)
from benchlib.records.metrics import GRAD_UNCHECKED_METRIC, harness_metric
from benchlib.analysis.engine_summary import Problem
from benchlib.analysis.stats import interleaved_order
from benchlib.trials.stopping import BUDGET, MAX_TRIALS, TRIALS_RUN, Deadline, TrialStopping

CHILD_PARAMS = ("malloc_policy", "malloc_env", "isolation", "worst_rank")  # worst_rank: of a step on several ranks
# the run's deadline (BENCHLIB_DEADLINE) comes from --budget or --timeout; the runner's summary names which
TIME_LIMIT = "the run's time limit (benchlib run --budget or --timeout) ran out"
NOT_RUN_MESSAGE = f"{TIME_LIMIT} before its first trial"
NOT_STARTED_MESSAGE = f"{TIME_LIMIT} before it started"

K = TypeVar("K")


def trial_order(units: Iterable[K], trials: int, seed: int | None,
                opens: Callable[[K], bool] = lambda unit: False) -> list[tuple[int, K]]:
    """(trial, unit) in the order the children run: every unit once per round, rounds shuffled by
    `seed` (A B A B when None) so machine drift falls on every unit alike; in the first round the
    units `opens` picks (each group's reference) come first, so every other unit's gradient has a
    reference to be checked against."""
    units = list(units)
    if not units:
        return []
    positions = interleaved_order(list(range(len(units))), trials, seed=seed)
    rounds = [[units[i] for i in positions[r * len(units):(r + 1) * len(units)]] for r in range(trials)]
    rounds[0].sort(key=lambda unit: not opens(unit))  # stable: the rest keep their shuffled order
    return [(trial, unit) for trial, round_units in enumerate(rounds) for unit in round_units]


def _saved_errors(folder: str, engine: str, reference: str, floor: float | None = None) -> dict[str, float]:
    """`engine`'s saved gradient against `reference`'s (also array by array, with a `floor`: `array_floor`);
    the engine's file is deleted once read."""
    errors = {GRAD_ERROR_METRIC: saved_gradient_error(folder, engine, reference)}
    if floor is not None:
        errors[WORST_ARRAY_METRIC] = saved_gradient_error(folder, engine, reference, floor=floor)
    gradient_file(folder, engine).unlink()
    return errors


def child_start_params(environment: Mapping) -> dict:
    """How the child was started, for the record's params: its allocator policy and the variables it set,
    and whether it was forked from a template or a fresh interpreter (`IsolatedResult.environment`)."""
    return {key: environment[key] for key in CHILD_PARAMS if key in environment}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or a signal turned into one) while a trial loop waited on a trial: carries the records of every
    trial that had finished, for the caller to save before the interrupt goes on."""

    def __init__(self, records: Sequence[dict]):
        super().__init__(f"interrupted after {len(records)} record(s)")
        self.records = list(records)


@dataclass(frozen=True)
class Unit:
    """What trials are run for: one engine on one group (a case, a model file's version).

    Units of one group share a reference gradient. `labels` are its records' (benchmark, case, engine,
    device, dtype); `params` every record of it carries; `trial_params` what a trial's records add
    (facts of the engine's set-up, say); `name` how progress lines name its group."""

    group: Hashable
    engine: str
    labels: Mapping[str, Any]
    params: Mapping[str, Any]
    name: str
    trial_params: Mapping[str, Any] = field(default_factory=dict)
    # Why another optimizer step with the same gradient means this engine does not apply (fused-optimizer
    # steps one optimizer per parameter); None: another step is a failure like a wrong gradient.
    regroups_optimizer: str | None = None
    # Its trial's check judged the gradient itself (a step on several ranks: against eager torch over every rank's
    # batch), so it needs no reference unit's saved gradient.
    judges_own_gradient: bool = False


def stopping_rule(max_trials: int, deadline: Deadline | None = None, precision: float = 0.0) -> TrialStopping:
    """The one place a stopping rule is built: at most `max_trials` per unit, within `deadline`, and (precision > 0)
    once a unit's peak settles. The trial loop's rule, and the studies that run their trials in one process
    (mnist_ensembles' grid, identical_closures' protocol) take theirs here with precision 0: count and deadline."""
    return TrialStopping(precision=precision, max_trials=max_trials, deadline=deadline)


@dataclass(frozen=True)
class TrialSettings:
    """How trials run: at most `trials` per unit, stopping once the peak's interval is within `precision`
    (0: every trial), rounds shuffled by `order_seed`, gradients checked against `reference`'s."""

    trials: int
    precision: float
    order_seed: int | None
    reference: str


@dataclass
class _Group:
    """One group's state while the loop runs: where its gradients are saved, why its engines' gradients cannot
    be compared (None once its reference was measured) and whether the reference's own gradient is stochastic."""

    folder: str
    no_reference: str | None
    seed_dependent: bool = False

    @classmethod
    def made(cls, root: str, index: int, reference: str) -> _Group:
        folder = os.path.join(root, f"group-{index}")
        os.mkdir(folder)
        return cls(folder, f"{reference} did not run, so there is no gradient to compare with")

    def lost(self, unit: Unit, reference: str, what: str) -> None:
        """The reference of this group failed or does not apply, before it was ever measured: say so to the rest."""
        if unit.engine == reference and self.no_reference is not None:
            self.no_reference = f"{what}, so there is no gradient to compare with"


class TrialLoop:
    """Runs units' trials and keeps their records, and `problems` (`Problem`s: failed, not run, not applicable)."""

    def __init__(self, settings: TrialSettings, progress: Callable[[str], None] | None = print):
        self.settings, self.progress = settings, progress
        self.records: list[dict] = []
        self.problems: list[Problem] = []

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def note(self, unit: Unit, status: str, message: str, params: Mapping | None = None) -> None:
        """A unit that did not measure: status "not applicable", "failed" or "not run", with the reason."""
        from benchlib.records import status_record

        self.records.append(status_record(**unit.labels, status=status.replace(" ", "_"), message=message,
                                          params=dict(unit.params if params is None else params)))
        self.problems.append(Problem(unit.labels["case"], unit.engine, status, message))
        self._say(f"{unit.name} {unit.engine}: {status}: {message.splitlines()[0]}")

    def _judge(self, unit: Unit, errors: Mapping[str, float], seed_dependent: bool) -> tuple[str | None, str]:
        """How `unit`'s gradient (and update) compare with the reference's: (None, "") when they agree within
        the dtype's tolerance; ("not comparable", why) when the reference is stochastic; ("not applicable",
        why) when the gradient agrees but the optimizer's step does not (the engine cannot make this file's
        step); ("failed", why) otherwise: not the same maths (NaN included)."""
        reference, dtype = self.settings.reference, unit.labels["dtype"]
        tolerance = gradient_tolerance(dtype)
        past = {metric: error for metric, error in errors.items()
                if tolerance is not None and not error <= error_limit(metric, dtype)}
        if not past:
            return None, ""
        if seed_dependent:
            stochastic = unit.params.get("stochastic_modules")
            named = f": {', '.join(stochastic)}" if stochastic else ""
            worst = max(past.values())
            return "not comparable", (f"not comparable: the step is stochastic ({reference}'s own gradient changes with "
                                      f"the random seed{named}), and {unit.engine}'s differs from it by {worst:.2g} "
                                      "from the same seed: other random draws cannot be told from other maths here")
        update = past.get(UPDATE_ERROR_METRIC)
        if GRAD_ERROR_METRIC not in past and WORST_ARRAY_METRIC in past:  # within the tolerance as a whole
            return "failed", (f"its gradient agrees with {reference}'s within the {dtype} tolerance {tolerance:g} as a "
                              f"whole, but one array of it differs by {past[WORST_ARRAY_METRIC]:.3g} of its own size, "
                              f"past {LOST_ARRAY:g}: {dtype} lost it (not the same maths)")
        if GRAD_ERROR_METRIC not in past and unit.regroups_optimizer and update is not None and math.isfinite(update):
            return "not applicable", (f"its gradient agrees with {reference}'s but the update its optimizer step makes "
                                      f"differs by {update:.3g} from the file's optimizer step on the same gradient "
                                      f"(the {dtype} tolerance is {tolerance:g}): {unit.regroups_optimizer}")
        if GRAD_ERROR_METRIC not in past:
            return "failed", (f"its gradient agrees with {reference}'s but the update its optimizer step makes differs "
                              f"by {update:.3g} from the file's optimizer step on the same gradient (the {dtype} "
                              f"tolerance is {tolerance:g}): not the same step")
        return "failed", (f"its gradient differs from {reference}'s by {past[GRAD_ERROR_METRIC]:.3g} (max relative "
                          f"error), past the {dtype} tolerance {tolerance:g}: not the same maths")

    def run(self, units: Sequence[Unit], measure: Callable[[Unit, int, str], Any], *,
            deadline: Deadline | None = None, first_always_runs: bool = True,
            keep: Callable[[Unit, int, Any], None] | None = None) -> None:
        """Every unit's trials, interleaved. `measure(unit, trial, gradient_dir)` runs one trial in a fresh
        process and returns its `IsolatedResult` (raising `CaseFailed` when it fails); its check saves
        the gradient into `gradient_dir` (one per group, deleted before this returns). `keep(unit, trial,
        result)` sees every measured trial. A unit stops at its `TrialStopping` reason, its first failure,
        or the deadline (`first_always_runs`: except the very first child)."""
        settings = self.settings
        stopping = stopping_rule(settings.trials, deadline, settings.precision)
        keys = {(unit.group, unit.engine): unit for unit in units}
        failed: set = set()
        with tempfile.TemporaryDirectory(prefix="benchlib-gradients-") as root:
            groups = {group: _Group.made(root, index, settings.reference)
                      for index, group in enumerate(dict.fromkeys(unit.group for unit in units))}
            order = trial_order(keys, settings.trials, settings.order_seed,
                                opens=lambda key: key[1] == settings.reference)
            for position, (trial, key) in enumerate(order):
                unit = keys[key]
                if key in failed or key in stopping.stopped:
                    continue
                if not (first_always_runs and position == 0) and not stopping.affords(key):
                    continue
                started = stopping.now()
                peak = self._trial(unit, (trial, position), measure, groups[unit.group], keep)
                if peak is None:  # failed or not applicable, and noted: its later trials would only repeat it
                    failed.add(key)
                    continue
                reason = stopping.add(key, peak, stopping.now() - started)
                if reason not in (None, MAX_TRIALS):
                    self._say(f"{unit.name} {unit.engine}: stopped after {trial + 1} trial(s) ({reason})")
        self._conclude(keys, failed, stopping)

    def _trial(self, unit: Unit, at: tuple[int, int], measure: Callable[[Unit, int, str], Any], group: _Group,
               keep: Callable[[Unit, int, Any], None] | None) -> float | None:
        """One trial of `unit` (`at`: the trial and its position in the order), measured, judged and recorded: the
        peak its stopping rule reads, or None where it failed or does not apply (noted)."""
        from benchlib.measure import CaseFailed, CaseNotApplicable

        (trial, position), trials, reference = at, self.settings.trials, self.settings.reference
        params = {**unit.params, **unit.trial_params, "trial": trial, "position": position}
        try:
            result = measure(unit, trial, group.folder)
        except KeyboardInterrupt:  # Ctrl-C, or a signal made one: what finished is the caller's to keep
            raise Interrupted(self.records) from None
        except CaseNotApplicable as error:  # the engine cannot run this code: no failure, no trials
            self.note(unit, "not applicable", error.reason)
            group.lost(unit, reference, f"{reference} does not apply")
            return None
        except CaseFailed as error:  # includes MemoryRequirementError: refused before it starts
            skipped = f" (its {trials - trial - 1} later trial(s) skipped)" if trial < trials - 1 else ""
            which = f"trial {trial + 1} of {trials}: " if trials > 1 else ""
            self.note(unit, "failed", f"{which}{error}{skipped}", params)
            group.lost(unit, reference, f"{reference} failed")
            return None
        params.update(child_start_params(result.environment))
        checks = dict(result.checks)
        verdict, why = self._gradient_verdict(unit, checks, group)
        if verdict == "not applicable":  # a different step: its figures would invite a comparison
            self.note(unit, "not applicable", why)
            return None
        unchecked = why if verdict in ("not comparable", "unchecked") else None
        self._record(unit, result, checks, params, unchecked)
        if keep is not None:
            keep(unit, trial, result)
        self._say(f"{unit.name} {unit.engine} trial {trial + 1}/{trials}: {result.measurement}"
                  + "".join(f", {k} {v:.3g}" for k, v in checks.items())
                  + (f", gradient not checked: {unchecked}" if unchecked is not None else ""))
        if verdict == "failed":  # measured, kept, and failed
            self.note(unit, "failed", why, params)
            return None
        return float(result.measurement.peak_bytes or 0)

    def _gradient_verdict(self, unit: Unit, checks: dict, group: _Group) -> tuple[str | None, str]:
        """How `unit`'s gradient compares with its group's reference, its errors moved into `checks`: (None, "")
        where it agrees, or is the reference (whose facts `group` takes); ("unchecked", why) with no reference
        to compare with; else `_judge`'s verdict."""
        reference = self.settings.reference
        if unit.engine == reference:
            group.no_reference, group.seed_dependent = None, bool(checks.get(SEED_DEPENDENT_METRIC))
            return None, ""
        if not unit.judges_own_gradient and group.no_reference is not None:
            return "unchecked", group.no_reference
        errors = ({metric: checks.pop(metric) for metric in (GRAD_ERROR_METRIC, WORST_ARRAY_METRIC) if metric in checks}
                  if unit.judges_own_gradient else
                  _saved_errors(group.folder, unit.engine, reference, array_floor(unit.labels["dtype"])))
        if UPDATE_ERROR_METRIC in checks:  # a step that regroups the optimizer judged its own update
            errors[UPDATE_ERROR_METRIC] = checks.pop(UPDATE_ERROR_METRIC)
        verdict, why = self._judge(unit, errors, group.seed_dependent and not unit.judges_own_gradient)
        if verdict != "not applicable":
            checks.update(errors)  # the measured differences, whatever they are judged
        return verdict, why

    def _record(self, unit: Unit, result, checks: Mapping[str, float], params: dict, unchecked: str | None) -> None:
        """A measured trial's records: its measurement, its checks, its breakdown rows, the harness's phases, and
        why its gradient was not checked, where it was not."""
        from benchlib.records import make_record

        measurement = result.measurement
        self.records += measurement.records(**unit.labels, params=params)
        self.records += [make_record(**unit.labels, metric=metric, value=value, params=params)
                         for metric, value in checks.items()]
        self.records += [make_record(**unit.labels, metric=row["metric"], value=row["value"],
                                     params={**params, **row["params"]}) for row in result.breakdown]
        self.records += [make_record(**unit.labels, metric=harness_metric(phase), value=seconds,
                                     params=params) for phase, seconds in (measurement.phase_s or {}).items()]
        if unchecked is not None:
            self.records.append(make_record(**unit.labels, metric=GRAD_UNCHECKED_METRIC, value=1.0,
                                            params={**params, "message": unchecked}))

    def _conclude(self, keys: Mapping[tuple, Unit], failed: set, stopping: TrialStopping) -> None:
        """Each unit that did not fail: its `trials_run` record (why it stopped), or `not run` where the budget
        left it none."""
        from benchlib.records import make_record

        for key, unit in keys.items():
            if key in failed:
                continue
            facts = stopping.stop_facts(key)
            count = facts.pop("trials_run")
            if count == 0:
                self.note(unit, "not run", NOT_RUN_MESSAGE)
                continue
            self.records.append(make_record(**unit.labels, metric=TRIALS_RUN, value=float(count),
                                            params={**unit.params, **facts}))
            if facts["stop"] == BUDGET:
                self._say(f"{unit.name} {unit.engine}: stopped after {count} trial(s) (budget)")
