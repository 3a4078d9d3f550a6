"""Every engine's step of a model file, each trial in a fresh process, interleaved across engines.

Engines that cannot run the file's step are recorded as not applicable with the reason; a case
whose child fails (the user's code raised, a crash, a timeout) is recorded as failed with its
message and the other cases still run. Gradients are compared with the reference engine's (eager
torch) in the parent. A `Form` says what differs between the torch form and the array form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchlib.benchmark import Config
from benchlib.engines import case_imports
from benchlib.engine_names import COMBINED
from benchlib.engines.techniques import (COMPILING, REFERENCE, SWEEP, BUILTIN, Aspect, StepFacts, TechniqueFault,
                                         TechniqueOptions, added_combinations, combine, technique_registry)
from benchlib.engines.module_memory import DEFAULT_DEPTH
from benchlib.engines.techniques.modules import stochastic_modules
from benchlib.trials import Deadline, TrialLoop, TrialSettings, Unit
from benchlib.usermodel.loader import ModelFile, top_level_imports

TARGET = "benchlib.usermodel.case:case"
RANKED_TARGET = "benchlib.usermodel.ranked:case"  # one rank's share of a step on several ranks
CASE = "step"
WARMUP = 1  # untimed steps per process: the optimizer's state exists before the baseline is read
STEPS = 5  # timed steps per process (their median is a trial's time)
ORDER_SEED = 0


@dataclass(frozen=True)
class EngineFacts:
    """One run's facts, from the file's pieces built once in the parent at the run's values."""

    reasons: dict[str, str]  # engine -> why it does not apply
    dtype: str
    engine_params: dict[str, dict]  # engine -> extra params its records carry
    params: dict = field(default_factory=dict)  # facts of the file at these values every record carries
    engine_dtypes: dict[str, str] = field(default_factory=dict)  # engine -> the dtype it computes in, where not
    # `dtype` (autocast): its records carry it, and its gradient is judged with that dtype's tolerance
    regroups_optimizer: dict[str, str] = field(default_factory=dict)  # engine -> why its optimizer step is its own
    failed: dict[str, str] = field(default_factory=dict)  # engine -> which of its techniques' own code raised


@dataclass(frozen=True)
class Form:
    """What a model file's form gives the run: the child target, its engines (the reference runs
    first) and `facts(model_file, values, device, engines, options) -> EngineFacts`."""

    target: str
    engines: tuple[str, ...]  # its engines; in the torch form, the techniques measured alone by default
    reference: str
    facts: Callable[..., EngineFacts]
    torch_categories: bool = False  # its child can add torch.profiler's categories (with `attribute`)
    imports: Callable[[Any, str, dict], tuple[str, ...]] = lambda model_file, engine, options: ()  # what (model
    # file, engine)'s step imports beyond its array library the first time it runs: its fork template preloads them
    sweep_engines: tuple[str, ...] = ()  # engines a first look (--quick) and fit leave out unless named
    compiling_engines: tuple[str, ...] = ()  # engines whose set-up compiles (seconds a trial, more than a small
    # step's whole measurement): a first look leaves them out too unless named
    composes: bool = False  # its engines are step techniques that join with "+" (`benchlib.engines.techniques`)


def technique_options(config: Config) -> dict:
    """The run's technique settings (`-p microbatches`, `-p sac_saved_ops`) as a child receives them (JSON)."""
    return TechniqueOptions(config.get("microbatches", TechniqueOptions.microbatches),
                            tuple(config.get("sac_saved_ops", None) or ())).to_json()


def _torch_facts(model_file: ModelFile, values: dict, device, engines, options: dict, world_size: int = 1) -> EngineFacts:
    model, _ = model_file.build(values)
    first = next(model.parameters(), None)
    registry = technique_registry(model_file.techniques)
    reasons, params, dtypes, regroups = {}, {}, {}, {}
    failed = {}
    for engine in engines:
        try:
            combination = combine(engine, registry, TechniqueOptions.from_json(options))
            ranks = world_size if placed(combination) else 1
            facts = StepFacts(model_file.optimizer is not None, model_file.step is not None, device.kind, ranks)
            reason = combination.not_applicable(model, facts)
            params[engine] = combination.params(model)
        except TechniqueFault as fault:  # that technique's steps fail, saying so; the others run
            failed[engine] = str(fault)
            continue
        if reason is not None:
            reasons[engine] = reason
        if combination.computes_in:
            dtypes[engine] = combination.computes_in
        if combination.regroups_optimizer:
            regroups[engine] = combination.regroups_optimizer
    stochastic = stochastic_modules(model)
    return EngineFacts(reasons, str(first.dtype).removeprefix("torch.") if first is not None else "float32", params,
                {"stochastic_modules": stochastic} if stochastic else {}, engine_dtypes=dtypes,
                regroups_optimizer=regroups, failed=failed)


def _torch_imports(model_file: ModelFile, engine: str, options: dict) -> tuple[str, ...]:
    combination = combine(engine, technique_registry(model_file.techniques), TechniqueOptions.from_json(options))
    return combination.imports(model_file.has_optimizer) + top_level_imports(model_file.path)


TORCH_FORM = Form(TARGET, tuple(BUILTIN), REFERENCE, _torch_facts, torch_categories=True, sweep_engines=SWEEP,
                  compiling_engines=COMPILING, imports=_torch_imports, composes=True)


def placed(combination) -> bool:
    """Whether the combination's step runs on several ranks (a parallel strategy is one of its parts)."""
    return combination.owner(Aspect.PLACEMENT) is not None


def spread_over_ranks(engines: list[str], parallel: str, registry, reference: str) -> list[str]:
    """Each engine on several ranks: as named where it has a parallel strategy, else under each strategy of `parallel`
    (comma-separated), `reference` standing for the strategy alone (`fsdp`, `fsdp+torch-checkpoint`)."""
    strategies = [part.strip() for part in str(parallel).split(",") if part.strip()]
    spread = [[engine] if placed(combine(engine, registry)) else
              [combine(strategy if engine == reference else f"{strategy}{COMBINED}{engine}", registry).name
               for strategy in strategies] for engine in engines]
    return list(dict.fromkeys(name for names in spread for name in names))


def _registry_name(engine: str, registry) -> str:
    """The engine's techniques in the registry's order; as given where one of its techniques' own checks raises
    (its steps fail, saying which: `EngineFacts.failed`)."""
    try:
        return combine(engine, registry).name
    except TechniqueFault:
        return engine


def run_engines(form: Form, config: Config, model_file) -> tuple[list[str], list[str]]:
    """The engines a run measures, the reference first: the named ones (`-p engines`), then, for a form whose
    engines compose, the combinations `-p combinations` adds; and which of them were added (they are left out
    where they do not apply, not recorded as not applicable). On several ranks (`-p ranks`), each named engine
    without a parallel strategy runs under each of `-p parallel` (`fsdp+torch-checkpoint`), eager torch in one
    process too, as the baseline; the default engines are eager torch alone and no combination is added."""
    if not form.composes:
        return [engine for engine in form.engines if engine in config.engines], []
    registry = technique_registry(model_file.techniques)
    ranks = int(config.get("ranks", 1))
    given = config.engines if ranks == 1 or tuple(config.engines) != tuple(form.engines) else (form.reference,)
    named = list(dict.fromkeys(_registry_name(engine, registry) for engine in given))
    if ranks > 1:
        named = [form.reference, *spread_over_ranks(named, config.get("parallel", ""), registry, form.reference)]
    if form.reference in named:
        named.insert(0, named.pop(named.index(form.reference)))
    added = added_combinations(config.get("combinations", "none") if ranks == 1 else "none", registry, named)
    return named + added, added


def preload(form: Form, model_file, engine: str, device, options: dict | None = None) -> tuple[str, ...]:
    """What a fork template preloads for `engine`'s cases of `model_file`: all its set-up and first step import."""
    return tuple(dict.fromkeys(case_imports(engine, device) + form.imports(model_file, engine, options or {})))


def measure_model_files(versions: Mapping[str, Any], form: Form, config: Config, device,
                        progress: Callable[[str], None] = print) -> list[dict]:
    """The records of every version's engines at `config`'s values on `device`, `config.trials` fresh
    processes each, all interleaved by the one trial loop (`benchlib.trials.TrialLoop`). Every version
    is of one form, whose `Form` gives the engines, the reference and the child. One version is case
    `step`; several are one case each, named by version."""
    from benchlib.measure import IsolationOptions, prepare_isolation

    run = _ModelRun.of(versions, form, config, device)
    first = next(iter(versions.values()))
    prepare_isolation(IsolationOptions(preload=preload(form, first, form.reference, device, run.options)))  # beside
    # the engine facts
    if run.ranks > 1:
        from benchlib.measure import rank_devices
        from benchlib.measure.ranks import crowded_cores

        rank_devices(device, run.ranks)  # refused before any work where the device cannot hold a rank each
        crowded = None if device.is_cuda else crowded_cores(run.ranks)
        if crowded:
            progress(f"{run.name}: {crowded}")
    loop = TrialLoop(TrialSettings(trials=config.trials, precision=float(config.get("precision", 0.0)),
                                   order_seed=ORDER_SEED, reference=form.reference), progress)
    units, labels, left_out = [], {}, {}
    for version, model_file in versions.items():
        units += run.version_units(loop, version, model_file, labels, left_out)
    for engine, reason in left_out.items():
        progress(f"{run.name} {engine}: left out of the combinations this run adds ({reason})")
    attributions: dict[tuple[str, str], dict] = {}

    def keep(unit: Unit, trial: int, result) -> None:
        if result.measurement.attribution is not None:
            attributions[unit.group, unit.engine] = result.measurement.attribution

    loop.run(units, run.measure, deadline=Deadline.from_environment(), keep=keep)
    records: dict[str, list[dict]] = {version: [] for version in versions}
    version_of = {case: version for version, case in run.cases.items()}
    for record in loop.records:
        records[version_of[record["case"]]].append(record)
    for version, rows in site_diffs(attributions, labels, run.cases, form.reference).items():
        records[version] += rows
    return [record for version in versions for record in records[version]]


@dataclass(frozen=True)
class _ModelRun:
    """What every case of one run of model files shares: the versions and their form, the values, the engines
    (and the combinations the run added), the technique options, the ranks and which engines run on them."""

    versions: Mapping[str, Any]
    form: Form
    config: Config
    device: Any
    values: dict
    engines: list[str]
    added: list[str]
    options: dict
    on_ranks: set[str]

    @classmethod
    def of(cls, versions: Mapping[str, Any], form: Form, config: Config, device) -> _ModelRun:
        first = next(iter(versions.values()))
        engines, added = run_engines(form, config, first)
        ranks = int(config.get("ranks", 1))
        on_ranks = {engine for engine in engines if ranks > 1 and placed(combine(engine, technique_registry(
            first.techniques)))} if form.composes else set()
        return cls(versions, form, config, device, {name: config.plain()[name] for name in first.parameters},
                   engines, added, technique_options(config) if form.composes else {}, on_ranks)

    @property
    def name(self) -> str:
        return next(iter(self.versions.values())).name

    @property
    def ranks(self) -> int:
        return int(self.config.get("ranks", 1))

    @property
    def cases(self) -> dict[str, str]:
        """Each version's case: `step` for one version, the version's name for several."""
        return {version: version if len(self.versions) > 1 else CASE for version in self.versions}

    def version_units(self, loop: TrialLoop, version: str, model_file: Any, labels: dict,
                      left_out: dict) -> list[Unit]:
        """One version's units, an engine each, its labels in `labels`; an engine that does not apply is noted in
        `loop` (an added combination is left out instead, with why in `left_out`)."""
        several, ranks = len(self.versions) > 1, self.ranks
        base = {**self.values, "file": str(model_file.path), **({"version": version} if several else {}),
                "trials": self.config.trials, "order_seed": ORDER_SEED, "warmup": WARMUP, "steps": STEPS}
        status = "not applicable"
        try:
            facts = self.form.facts(model_file, self.values, self.device, self.engines, self.options,
                                    **({"world_size": ranks} if ranks > 1 else {}))
        except Exception as error:  # the user's code fails at these values: every case fails alike
            message = model_file.user_error(error, "building the case (at the run's values)")
            status, facts = "failed", EngineFacts(dict.fromkeys(self.engines, message), "float32", {})
        base.update(facts.params)
        units = []
        for engine in self.engines:
            if engine in self.added and engine in facts.reasons and status != "failed":
                left_out.setdefault(engine, facts.reasons[engine])  # an added combination that does not apply
                continue
            labels[version, engine] = dict(benchmark=self.name, case=self.cases[version], engine=engine,
                                           device=self.device.name, dtype=facts.engine_dtypes.get(engine, facts.dtype))
            unit = Unit(group=version, engine=engine, labels=labels[version, engine],
                        params={**base, "world_size": ranks} if engine in self.on_ranks else base,
                        name=f"{self.name} {version}" if several else self.name,
                        trial_params=facts.engine_params.get(engine, {}),
                        regroups_optimizer=facts.regroups_optimizer.get(engine),
                        judges_own_gradient=engine in self.on_ranks)
            if engine in facts.failed:
                loop.note(unit, "failed", facts.failed[engine])
            elif engine in facts.reasons:
                loop.note(unit, status, facts.reasons[engine])
            else:
                units.append(unit)
        return units

    def measure(self, unit: Unit, trial: int, gradient_dir: str):
        """One trial of `unit` in fresh processes: a rank each where it runs on ranks, else one child of the form."""
        from benchlib.measure import IsolationOptions, rank_devices, run_isolated, run_ranks
        from benchlib.measure.allocations import memray_available
        from benchlib.measure.cuda_snapshot import snapshot_path

        device, options, form = self.device, self.options, self.form
        depth = int(self.config.get("module_depth", DEFAULT_DEPTH))
        track = device.is_cuda or memray_available()
        # the attribution passes (sites, and torch's categories) in one process's first trial
        traced = bool(self.config.get("attribute", False)) and trial == 0 and unit.engine not in self.on_ranks
        case_name = f"{self.name}/{self.cases[unit.group]}/{unit.engine}"
        path = str(self.versions[unit.group].path)
        if unit.engine in self.on_ranks:
            return Deadline.from_environment().within(lambda limit: run_ranks(
                RANKED_TARGET, {"path": path, "engine": unit.engine, "values": self.values, "options": options,
                                "module_depth": depth},
                name=case_name, world_size=self.ranks, devices=rank_devices(device, self.ranks),
                options=IsolationOptions(warmup=WARMUP, repeats=STEPS, track_allocations=track, timeline=False,
                                         timeout_s=limit)), IsolationOptions.timeout_s)
        return Deadline.from_environment().within(lambda limit: run_isolated(
            form.target, {"path": path, "engine": unit.engine, "values": self.values, "gradient_dir": gradient_dir,
                          **({"options": options, "module_depth": depth} if form.composes else {}),
                          **({"check": "categories"} if traced and form.torch_categories else {})},
            name=case_name, device=device.name,
            options=IsolationOptions(warmup=WARMUP, repeats=STEPS, track_allocations=track, timeline=False,
                                     attribute=traced, cuda_snapshot=snapshot_path(case_name, device) if trial == 0
                                     else None, timeout_s=limit,
                                     preload=preload(form, self.versions[unit.group], unit.engine, device,
                                                     options))), IsolationOptions.timeout_s)


def site_diffs(attributions: Mapping[tuple[str, str], dict], labels: Mapping[tuple[str, str], dict],
               cases: Mapping[str, str], reference: str) -> dict[str, list[dict]]:
    """Diff records (kind `diff`) of the attribution passes, per version: each engine's peak sites against
    the reference engine's (by line and function), and each later version's against the first version's
    under the same engine (by function and the innermost frame: the files and their lines differ)."""
    from benchlib.analysis.sites import diff_records, diff_sites, pass_sites

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
