"""A memory gate on one gradient step of a model file, for users' own test suites and CI.

`measure_step` runs one engine's step of a model file in a fresh process (the child `benchlib run`
uses) and returns its `StepCost`: the tracked peak (the most bytes live at once as the allocators saw
them: the same number for the same code path, so a limit on it does not flake), both allocation
counts, memory by role and the lines holding the peak. `check_step` holds it to `Limits` (absolute,
or a growth ratio over a stored baseline) and says by how much it missed, which role grew and where.
`Baselines` keeps steps as JSON, one file per test. The pytest plugin (`benchlib.pytest_plugin`) is
the glue to pytest.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib.errors import Refused
from benchlib.engines import DYNAMO, case_imports
from benchlib.analysis.modules import ROLE_WORDS
from benchlib.engines.roles import GRADIENT_METRIC, OPTIMIZER_METRIC, PARAMETER_METRIC, SAVED_METRIC
from benchlib.measure.allocations import PeakSite
from benchlib.records.metrics import MODULE_METRIC
from benchlib.source_files import is_library
from benchlib.units import format_bytes, format_count, parse_bytes

ROLE_NAMES = {PARAMETER_METRIC: "parameters", GRADIENT_METRIC: "gradients", SAVED_METRIC: "saved activations",
              OPTIMIZER_METRIC: "optimizer state"}
BASELINE_FORMAT = 1
# What a torch step's set-up imports anyway: torch.optim imports torch._dynamo on first use (0.8 s on a 2-core
# machine). The gate's template imports it beside the model file's import here, before the file says whether it
# has an optimizer (`benchlib run` asks `step_imports` once it knows); its children own the pages (`forkserver`).
GATE_PRELOAD = (DYNAMO,)


class GateError(Refused):
    """A gate that cannot be checked as written: a limit that does not parse, an engine that is not
    the form's or does not apply, a baseline of another benchmark. Never a pass."""


def parse_count(value: Any) -> int:
    """An allocation-count limit: a whole number >= 0 (or its text, "20000", "20_000")."""
    text = value.replace("_", "").strip() if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if text is not None and text.isdigit():
        return int(text)
    raise GateError(f"{value!r} is not an allocation count; valid: a whole number >= 0, e.g. 20000")


def parse_ratio(value: Any) -> float:
    """A growth limit over the baseline: a ratio >= 1 ("1.2x", 1.2; "1x" allows no growth at all)."""
    text = value.strip().lower().removesuffix("x").strip() if isinstance(value, str) else None
    try:
        ratio = float(text) if text is not None else float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        ratio = None
    if ratio is None or not ratio >= 1 or ratio == float("inf"):
        raise GateError(f"{value!r} is not a growth ratio; valid: a ratio >= 1 over the baseline, e.g. '1.2x' or 1.1")
    return ratio


@dataclass(frozen=True)
class Limits:
    """What a step may cost: `peak` bytes and `allocations` (system allocator) or `python_allocations`
    at most, and at most `growth` times the stored baseline's peak and allocation counts."""

    peak: int | None = None
    allocations: int | None = None
    python_allocations: int | None = None
    growth: float | None = None

    @classmethod
    def parse(cls, peak: Any = None, allocations: Any = None, python_allocations: Any = None,
              growth: Any = None) -> "Limits":
        return cls(None if peak is None else parse_bytes(peak),
                   None if allocations is None else parse_count(allocations),
                   None if python_allocations is None else parse_count(python_allocations),
                   None if growth is None else parse_ratio(growth))

    def merged(self, other: "Limits") -> "Limits":
        """These limits with `other`'s where it sets one."""
        return Limits(**{name: value if value is not None else getattr(self, name)
                         for name, value in asdict(other).items()})


@dataclass(frozen=True)
class StepCost:
    """One engine's gradient step of a model file, measured in a fresh process."""

    name: str  # the file's NAME
    path: str
    engine: str
    device: str
    values: dict  # the file's PARAMETERS as measured
    peak_bytes: int  # tracked peak
    alloc_count: int
    alloc_count_python: int | None
    resident_peak_bytes: int | None
    roles: dict = field(default_factory=dict)  # role name -> bytes
    sites: tuple = ()  # PeakSite, largest first
    modules: dict = field(default_factory=dict)  # module path -> {role: bytes} (`benchlib.engines.module_memory`)

    @property
    def key(self) -> str:
        """What a baseline must share with this step to be its baseline."""
        return json.dumps([self.name, self.engine, self.device, self.values], sort_keys=True, default=str)

    def to_json(self) -> dict:
        return {**asdict(self), "sites": [asdict(site) for site in self.sites]}

    @classmethod
    def from_json(cls, data: dict) -> "StepCost":
        return cls(**{**data, "sites": tuple(PeakSite(**site) for site in data.get("sites", ()))})

    def __str__(self) -> str:
        python = "" if self.alloc_count_python is None else f", {format_count(self.alloc_count_python)} Python allocations"
        where = f"; top site {self.sites[0]}" if self.sites else ""
        return (f"{self.name} under {self.engine} on {self.device}: peak {format_bytes(self.peak_bytes)}, "
                f"{format_count(self.alloc_count)} allocations{python}{where}")


def _largest_role(cost: StepCost) -> str:
    if not cost.roles:
        return ""
    role, size = max(cost.roles.items(), key=lambda item: item[1])
    return f"; the largest role: {role} {format_bytes(int(size))}"


def _grown_role(cost: StepCost, baseline: StepCost) -> str:
    growth = {role: size - baseline.roles.get(role, 0.0) for role, size in cost.roles.items()}
    if not growth or max(growth.values()) <= 0:
        return f"; none of the roles measured under {cost.engine} grew ({', '.join(cost.roles)})" if cost.roles else ""
    role, size = max(growth.items(), key=lambda item: item[1])
    return f"; {role} grew the most: +{format_bytes(int(size))} ({format_bytes(int(baseline.roles.get(role, 0)))} -> " \
           f"{format_bytes(int(cost.roles[role]))})"


def _module_bytes(cost: StepCost) -> dict[tuple[str, str], float]:
    return {(module, role): size for module, roles in cost.modules.items() for role, size in roles.items()}


def _largest_module(cost: StepCost) -> str:
    totals = {module: sum(roles.values()) for module, roles in cost.modules.items()}
    if not totals:
        return ""
    module = max(totals, key=totals.get)
    return f"; the largest module: {module} {format_bytes(int(totals[module]))}"


def _grown_module(cost: StepCost, baseline: StepCost) -> str:
    """The module and role that grew the most over the baseline, by bytes, with their ratio."""
    before, after = _module_bytes(baseline), _module_bytes(cost)
    growth = {key: size - before.get(key, 0.0) for key, size in after.items()}
    if not growth or max(growth.values()) <= 0:
        return ""
    (module, role), size = max(growth.items(), key=lambda item: item[1])
    old = before.get((module, role), 0.0)
    ratio = f", {after[module, role] / old:.2f}x" if old else ", new"
    return (f"; the module that grew the most: {module} ({ROLE_WORDS.get(role, role)} +{format_bytes(int(size))}: "
            f"{format_bytes(int(old))} -> {format_bytes(int(after[module, role]))}{ratio})")


def _site(cost: StepCost) -> str:
    """The line holding most of the peak, and the user's own line holding most when that one is a library's
    (backward's buffers are allocated inside torch, with no line of the model on the stack)."""
    if not cost.sites:
        return ""
    top = cost.sites[0]
    own = next((site for site in cost.sites if not is_library(site.file)), None)
    mine = f"; your line holding most: {own}" if own is not None and own is not top else ""
    return f"; top site at the peak: {top}{mine}"


def check_step(cost: StepCost, limits: Limits, baseline: StepCost | None = None,
               baseline_file: str = "the baselines") -> list[str]:
    """Why `cost` fails `limits` (one sentence each); empty when it passes. A growth limit without a
    baseline fails: a gate that cannot be checked never passes."""
    problems = []
    what = f"{cost.name} under {cost.engine}"
    if limits.peak is not None and cost.peak_bytes > limits.peak:
        over = cost.peak_bytes - limits.peak
        problems.append(f"{what}: peak {format_bytes(cost.peak_bytes)} exceeds the limit {format_bytes(limits.peak)} by "
                        f"{format_bytes(over)} ({100 * over / max(limits.peak, 1):.1f}%){_largest_role(cost)}{_largest_module(cost)}"
                        f"{_site(cost)}")
    for label, value, limit in (("allocations", cost.alloc_count, limits.allocations),
                                ("Python allocations", cost.alloc_count_python, limits.python_allocations)):
        if limit is not None and value is not None and value > limit:
            problems.append(f"{what}: {format_count(value)} {label} exceed the limit {format_count(limit)} by "
                            f"{format_count(value - limit)}{_site(cost)}")
        if limit is not None and value is None:
            problems.append(f"{what}: {label} were not counted on {cost.device}, so the limit cannot be checked")
    if limits.growth is None:
        return problems
    if baseline is None:
        return problems + [f"{what}: no baseline at these values in {baseline_file}, so growth cannot be checked; "
                           "record one with `pytest --benchlib-save-baselines`"]
    if baseline.name != cost.name:
        raise GateError(f"{baseline_file} holds a baseline of {baseline.name!r}, not of {cost.name!r}: a baseline is "
                        "compared with the same benchmark only")
    for label, value, before in (("peak", cost.peak_bytes, baseline.peak_bytes),
                                 ("allocations", cost.alloc_count, baseline.alloc_count)):
        ratio = value / before if before else (1.0 if value == 0 else float("inf"))
        if ratio > limits.growth:
            shown = format_bytes if label == "peak" else format_count
            problems.append(f"{what}: {label} grew {ratio:.2f}x over the baseline ({shown(before)} -> {shown(value)}, "
                            f"+{shown(value - before)}; allowed {limits.growth:g}x){_grown_role(cost, baseline)}"
                            f"{_grown_module(cost, baseline) if label == 'peak' else ''}{_site(cost)}")
    return problems


class Baselines:
    """Stored steps, one JSON file per test under `folder`, matched by `StepCost.key`."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def file(self, test_id: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id).strip("_") + ".json")

    def _steps(self, test_id: str) -> list[dict]:
        path = self.file(test_id)
        if not path.is_file():
            return []
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != BASELINE_FORMAT:
                raise ValueError(f"format {data.get('format')!r}, where this benchlib reads format {BASELINE_FORMAT}")
            steps = list(data["steps"])
            for step in steps:
                _check_baseline(StepCost.from_json(step))
            return steps
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise GateError(f"{path} is not a benchlib baseline file ({error}); delete it and record it again "
                            "with `pytest --benchlib-save-baselines`") from None

    def get(self, test_id: str, cost: StepCost) -> StepCost | None:
        """The baseline of `cost`'s step in this test; a file that holds another benchmark's steps only is refused."""
        steps = [StepCost.from_json(step) for step in self._steps(test_id)]
        same = [step for step in steps if step.key == cost.key]
        if not same and steps and all(step.name != cost.name for step in steps):
            raise GateError(f"{self.file(test_id)} holds baselines of {sorted({step.name for step in steps})}, "
                            f"not of {cost.name!r}: a baseline is compared with the same benchmark only")
        return same[0] if same else None

    def save(self, test_id: str, cost: StepCost) -> Path:
        """`cost` as this test's baseline of its step, beside the test's others. Savers take turns on the folder (a
        lock), each writing a temporary file of its own, so processes saving at once (pytest-xdist's workers) never
        lose each other's steps or leave a file half written."""
        import fcntl

        path = self.file(test_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            steps = [step for step in self._steps(test_id) if StepCost.from_json(step).key != cost.key]
            text = json.dumps({"format": BASELINE_FORMAT, "test": test_id, "steps": [*steps, cost.to_json()]}, indent=1)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text + "\n")
            os.replace(temporary, path)
        finally:
            os.close(folder)  # and with it the lock
        return path


def _check_baseline(step: StepCost) -> None:
    """A stored step's counts are sizes: a negative or non-numeric one would make every growth limit pass."""
    for name in ("peak_bytes", "alloc_count"):
        value = getattr(step, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} is {value!r}; a baseline's {name} is a number >= 0")


def measure_step(model: str | Path, engine: str = "torch", *, params: dict | None = None, quick: bool = False,
                 device: str = "cpu", sites: bool = True, timeout_s: float = 600) -> StepCost:
    """One `engine` step of the model file at `model` (its PARAMETERS, the QUICK ones with `quick`, then
    `params`), measured in a fresh process: a warm-up step, then one under the allocation tracker. The
    template that process forks from starts first, so its imports overlap the model file's here."""
    from benchlib.measure import (CaseFailed, CaseNotApplicable, IsolationOptions, prepare_isolation, resolve_device,
                                  run_isolated)
    from benchlib.measure.allocations import memray_available

    target = resolve_device(device)
    torch_imports = case_imports(engine, target)
    options = IsolationOptions(warmup=1, repeats=1, track_allocations=True, timeline=False, sites=sites,
                               timeout_s=timeout_s, preload=tuple(dict.fromkeys(torch_imports + GATE_PRELOAD)) if torch_imports else ())
    prepare_isolation(options)
    from benchlib.usermodel import declare_model_files  # torch and the model file: beside the template's imports
    from benchlib.usermodel.named import resolved

    benchmark, (model_file,), form = declare_model_files([resolved(model)])
    if not form.composes and engine not in form.engines:
        raise GateError(f"{engine!r} is not an engine of {model_file.path.name}'s form; valid: {', '.join(form.engines)}")
    if form.composes:
        from benchlib.engines.techniques import CombinationError
        from benchlib.usermodel.case import combination_of

        try:
            combination_of(model_file, engine)
        except CombinationError as error:
            raise GateError(f"{engine!r} is not an engine of {model_file.path.name}'s form: {error}") from None
    values = benchmark.config({**(benchmark.quick if quick else {}), **(params or {})}).plain()
    values = {name: values[name] for name in model_file.parameters}
    if not target.is_cuda and not memray_available():
        raise GateError("a gate on CPU counts allocations with memray (Linux and macOS): pip install memray")
    reason = form.facts(model_file, values, target, [engine], {}).reasons.get(engine)
    if reason is not None:
        raise GateError(f"{engine} does not apply to {model_file.path}: {reason}")
    with tempfile.TemporaryDirectory(prefix="benchlib-gate-") as gradients:
        try:
            result = run_isolated(form.target, {"path": str(model_file.path), "engine": engine, "values": values,
                                                "gradient_dir": gradients},
                                  name=f"{model_file.name}/{engine}", device=target.name, options=options)
        except CaseNotApplicable as refused:  # the engine cannot run this code (torch.func's limits)
            raise GateError(f"{engine} does not apply to {model_file.path}: {refused.reason}") from None
        except CaseFailed as failed:
            raise GateError(f"{model_file.path} under {engine}: {failed.reason}"
                            + (f"\n{failed.child_traceback.strip().splitlines()[-1]}" if failed.child_traceback else "")
                            ) from None
    measurement = result.measurement
    return StepCost(model_file.name, str(model_file.path), engine, target.name, values,
                    int(measurement.tracked_peak_bytes), int(measurement.alloc_count),
                    measurement.alloc_count_python, measurement.peak_bytes,
                    {ROLE_NAMES[name]: value for name, value in result.checks.items() if name in ROLE_NAMES},
                    tuple(PeakSite(**site) for site in measurement.peak_sites or ()), _modules(result.breakdown))


def _modules(breakdown) -> dict[str, dict[str, float]]:
    """A step's memory by module as a baseline keeps it: module path -> {role: bytes}."""
    modules: dict[str, dict[str, float]] = {}
    for row in breakdown:
        if row["metric"] == MODULE_METRIC:
            modules.setdefault(row["params"]["module"], {})[row["params"]["role"]] = row["value"]
    return modules
