"""A model file (or versions of one NAME) as a `benchlib.Benchmark`: read in its form, its PARAMETERS typed
by their defaults, checked by one loss call at the QUICK values, declared (`declaration`), measured by
`measuring.measure_model_files`."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchlib.errors import Refused
from benchlib.benchmark import Benchmark, DeclarationError, Parameter, ParameterError
from benchlib.engine_names import COMBINED, DEFAULT_COMBINATIONS, PARALLEL_STRATEGIES
from benchlib.engines.module_memory import DEFAULT_DEPTH
from benchlib.engines.namespaces import SAC_SAVED_OPS, unknown_aten_ops
from benchlib.engines.techniques import (COMBINATION_CHOICES, Aspect, CombinationError, TechniqueFault,
                                         TechniqueOptions, combine, technique_registry)
from benchlib.engines.techniques import DEFAULT as DEFAULT_CHOICE, NONE as NONE_CHOICE
from benchlib.trials.cases import PRECISION, trials_parameter
from benchlib.usermodel.case import CASE_METRICS
from benchlib.report.plots.usermodel import frontier, memory_by_role, peak_intervals
from benchlib.usermodel.arrays import ARRAY_FORM_RUN, ArrayModelFile, array_form, check_array_form
from benchlib.usermodel.measuring import TORCH_FORM, Form, measure_model_files
from benchlib.records.environment import file_digest
from benchlib.usermodel.loader import (ModelFileError, check_form, is_array_form, open_model_file, torch_form)
from benchlib.usermodel.summary import summary_table

TRIALS = trials_parameter(5)
ATTRIBUTE = Parameter("attribute", False, "one more traced pass per engine (in its first trial, after the measured "
                                          "ones): the lines holding the peak, temporaries, diffs between engines "
                                          "(`benchlib run --attribute`)")
MODULE_DEPTH = Parameter("module_depth", DEFAULT_DEPTH, "the levels of module path memory by module keeps (a "
                         "container's index joins its container: encoder.layers.3 is two levels)", minimum=1)
HEADLINE = ("peak_bytes", "tracked_peak_bytes", "time", "alloc_count", "alloc_count_python", "gc_time")


def _engine_choice(form: Form) -> Parameter:
    left_out = tuple(engine for engine in form.engines if engine in (*form.sweep_engines, *form.compiling_engines))
    first_look = tuple(engine for engine in form.engines if engine not in left_out)
    joined = (f"; techniques join with '{COMBINED}' into one step (-p engines=torch-autocast{COMBINED}torch-checkpoint)"
              if form.composes else "")
    return Parameter("engines", tuple(form.engines), "the engines to measure"
                     + (f" (--quick leaves out {', '.join(left_out)})" if left_out else "") + joined,
                     choices=() if form.composes else form.engines, **({"quick": first_look} if left_out else {}))


SAC_POLICY = Parameter("sac_saved_ops", SAC_SAVED_OPS, "the aten ops whose outputs torch-sac saves; every other op "
                                                      "is recomputed in backward (e.g. -p sac_saved_ops=mm,addmm)")
COMBINATIONS = Parameter("combinations", DEFAULT_CHOICE, "the combinations of techniques measured beside the engines: "
                         f"{DEFAULT_CHOICE} ({', '.join(DEFAULT_COMBINATIONS)}, where they apply), all (every valid "
                         "one) or none (--quick: none)", quick=NONE_CHOICE, choices=COMBINATION_CHOICES)
RANKS = Parameter("ranks", 1, "the torch.distributed ranks each engine's step runs on under -p parallel (gloo on the "
                  "CPU, NCCL on CUDA, a GPU per rank); 1: one process (benchlib run --ranks N)", minimum=1)
PARALLEL = Parameter("parallel", "", f"with ranks > 1, the parallel strategies each engine runs under, joined by "
                     f"commas: {', '.join(PARALLEL_STRATEGIES)} (benchlib run --parallel ddp,fsdp)")
MICROBATCHES = Parameter("microbatches", TechniqueOptions.microbatches, "the parts torch-microbatch splits the batch "
                         "into, alone or combined", minimum=2)


def _technique_rules(model_file, config) -> None:
    """Refused before any work: a SAC policy naming an op aten does not have (it would silently save nothing of
    it), an engine that names no technique, techniques that cannot join in one step, or more ranks than the memory
    free holds."""
    unknown = unknown_aten_ops(config.get("sac_saved_ops", ()))
    if unknown:
        raise Refused(f"sac_saved_ops: {', '.join(map(repr, unknown))} is no op of torch.ops.aten; valid: aten op "
                         f"names without overload, such as the default {', '.join(SAC_SAVED_OPS)}")
    registry = technique_registry(getattr(model_file, "techniques", {}))
    placed = []
    for engine in config.get("engines", ()):
        try:
            combination = combine(engine, registry)
        except CombinationError as error:
            raise Refused(f"engines: {error}") from None
        except TechniqueFault:  # that engine's steps fail, saying so (the engine facts); the others run
            continue
        if combination.owner(Aspect.PLACEMENT) is not None:
            placed.append(engine)
    ranks, strategies = config.get("ranks", 1), parallel_strategies(config)
    if ranks > 1 and not (strategies or placed):
        raise Refused(f"ranks={ranks}: say how the step is spread over them: --parallel "
                         f"{' or '.join(PARALLEL_STRATEGIES)} (-p parallel=fsdp), or an engine that names one "
                         f"(-p engines=fsdp+torch-checkpoint)")
    if ranks == 1 and (strategies or placed):
        raise Refused(f"{', '.join(strategies or placed)} runs on several ranks: give --ranks N (N >= 2)")
    resident = getattr(model_file, "resident_bytes", None)  # known where a child read the file (`reading`)
    if ranks > 1 and resident:
        from benchlib.measure.ranks import refuse_ranks_beyond_memory

        refuse_ranks_beyond_memory(ranks, resident)


def parallel_strategies(config) -> list[str]:
    """The strategies `-p parallel` names (comma-separated), or ValueError saying which are valid."""
    named = [part.strip() for part in str(config.get("parallel", "")).split(",") if part.strip()]
    unknown = [name for name in named if name not in PARALLEL_STRATEGIES]
    if unknown:
        raise Refused(f"parallel: {', '.join(map(repr, unknown))} is no parallel strategy; valid: "
                         f"{', '.join(PARALLEL_STRATEGIES)}, or both joined by a comma")
    return list(dict.fromkeys(named))


def _parameters(model_file, form: Form) -> tuple[Parameter, ...]:
    own = (TRIALS, PRECISION, _engine_choice(form), ATTRIBUTE,  # benchlib's parameters of every model file
           *((COMBINATIONS, MICROBATCHES, SAC_POLICY, MODULE_DEPTH, RANKS, PARALLEL) if form.composes else ()))
    parameters = []
    for name, default in model_file.parameters.items():
        if name in {each.name for each in own}:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] is benchlib's own ({name}: "
                                 f"{next(each.help for each in own if each.name == name)}); give yours another name")
        quick = {"quick": model_file.quick[name]} if name in model_file.quick else {}
        try:
            parameters.append(Parameter(name, default, f"from {model_file.path.name}'s PARAMETERS", **quick))
        except (DeclarationError, ParameterError) as error:
            raise ModelFileError(f"{model_file.path}: PARAMETERS[{name!r}] = {default!r}"
                                 + (f", QUICK {model_file.quick[name]!r}" if quick else "") + f": {error}") from None
    return (*parameters, *own)


def version_labels(paths: Sequence[str | Path]) -> list[str]:
    """Each file's version: its stem, or its path where two stems are the same."""
    stems = [Path(path).stem for path in paths]
    return [stem if stems.count(stem) == 1 else str(path) for stem, path in zip(stems, paths)]


def load_model_file(path: str | Path) -> Benchmark:
    """The benchmark a model file declares, its form checked by one loss call at the QUICK values."""
    return load_model_files([path])


def _read(path: str | Path):
    """The file, read in its form: the array form's pieces where it declares them, else the torch form's."""
    path, module = open_model_file(path)
    return array_form(path, module) if is_array_form(module) else torch_form(path, module)


def _form_name(model_file) -> str:
    return "array form" if isinstance(model_file, ArrayModelFile) else "torch form"


def load_model_files(paths: Sequence[str | Path], checked: Mapping[str, str] | None = None) -> Benchmark:
    """One benchmark of the files (versions of one NAME, of one form, at the same PARAMETERS and QUICK),
    each file's form checked by one loss call at the QUICK values (not again where `checked` holds its digest)."""
    return declare_model_files(paths, checked=checked)[0]


def declare_model_files(paths: Sequence[str | Path], shapes_only: bool = False,
                        checked: Mapping[str, str] | None = None) -> tuple[Benchmark, list, Form]:
    """`load_model_files`' benchmark, with the files read and their form (for one engine's step alone); with
    `shapes_only`, the torch form checked from shapes alone where the step allows (`check_form`). `checked` maps
    a resolved path to the digest (`file_digest`) of the content a form check already passed (the runner's reading
    child, moments before this kernel): a file still of that content is not checked again (the check's loss and
    optimizer calls import torch's dynamo stack, seconds a run)."""
    passed = {str(Path(path).expanduser().resolve()) for path in paths
              if checked and checked.get(str(Path(path).expanduser().resolve())) == file_digest(path)}
    files = [_read(path) for path in paths]
    model_file = files[0]
    for other in files[1:]:
        if other.name != model_file.name:
            raise ModelFileError(f"{other.path}: NAME {other.name!r} is not {model_file.path.name}'s {model_file.name!r}; "
                                 "versions of one benchmark share a NAME (run different NAMEs as separate arguments)")
        if _form_name(other) != _form_name(model_file):
            raise ModelFileError(f"{other.path}: it is of the {_form_name(other)}, {model_file.path.name} of the "
                                 f"{_form_name(model_file)}; versions of one benchmark are of one form, so their "
                                 "engines are the same")
        if (other.parameters, other.quick) != (model_file.parameters, model_file.quick):
            raise ModelFileError(f"{other.path}: PARAMETERS or QUICK differ from {model_file.path}'s; versions of one "
                                 "benchmark run at the same values, so their ratio compares the code alone")
    arrays = isinstance(model_file, ArrayModelFile)
    form = ARRAY_FORM_RUN if arrays else TORCH_FORM
    parameters = _parameters(model_file, form)
    quick = {p.name: p.quick if p.has_quick else p.default for p in parameters[:len(model_file.parameters)]}
    for each in files:
        if str(Path(each.path).resolve()) in passed:
            continue
        values = {name: list(v) if isinstance(v, tuple) else v for name, v in quick.items()}
        check_array_form(each, values) if arrays else check_form(each, values, shapes_only)
    versions = dict(zip(version_labels([f.path for f in files]), files))
    return declaration(files, arrays, functools.partial(measure_model_files, versions, form)), files, form


def declaration(files: Sequence, arrays: bool, measure) -> Benchmark:
    """The benchmark of model files already read and checked: `files` give path, name, parameters and
    quick (the files themselves, or their facts as a child that checked them reported them:
    `benchlib.usermodel.reading`), `measure` measures them."""
    model_file, form = files[0], ARRAY_FORM_RUN if arrays else TORCH_FORM
    names = " and ".join(Path(f.path).name for f in files)
    step = "one gradient of the loss with respect to the params arrays" if arrays else \
        "one training step (forward, backward and, when the file declares one, the optimizer's step)"
    roles = "" if arrays else ", memory by role"
    return Benchmark(
        name=model_file.name,
        question=f"What does one gradient step of {names} cost in memory, allocations and time under each "
                 "engine, and which gets it under a memory level fastest?",
        cases=f"{step} per engine, each in fresh processes, `trials` times interleaved (across versions too): peak, "
              f"time, both allocation counts, GC pauses{roles} and the gradient's error against eager torch",
        parameters=_parameters(model_file, form),
        measure=measure,
        headline=HEADLINE,
        metrics=CASE_METRICS,
        summarize=summary_table,
        rules=None if arrays else functools.partial(_technique_rules, model_file),
        figures={"frontier": frontier, "peak": peak_intervals, **({} if arrays else {"roles": memory_by_role})},
    )

