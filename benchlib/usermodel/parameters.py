"""A model file's parameters as benchlib takes them: its own PARAMETERS typed by their defaults, benchlib's own
(trials, engines, techniques' settings, ranks), and the rules over them, checked before any work. `file_benchmark`
is the file as a benchmark with these alone: `fit` asks its question with it (importing none of the report), and
`declare.declaration` adds the summary and figures a run shows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
import functools

from benchlib.benchmark import Benchmark, DeclarationError, Parameter, ParameterError
from benchlib.engine_names import (COMBINED, DEFAULT_COMBINATIONS, PARALLEL_STRATEGIES, no_ranks, no_spread,
                                   parallel_strategies_named)
from benchlib.engines.module_memory import DEFAULT_DEPTH
from benchlib.engines.namespaces import SAC_SAVED_OPS, unknown_aten_ops
from benchlib.engines.techniques import (COMBINATION_CHOICES, Aspect, CombinationError, TechniqueFault,
                                         TechniqueOptions, combine, technique_registry)
from benchlib.engines.techniques import DEFAULT as DEFAULT_CHOICE, NONE as NONE_CHOICE
from benchlib.errors import Refused
from benchlib.trials.cases import PRECISION, trials_parameter
from benchlib.usermodel.arrays import ARRAY_FORM_RUN
from benchlib.usermodel.loader import ModelFileError
from benchlib.usermodel.measuring import TORCH_FORM, Form

TRIALS = trials_parameter(5)
ATTRIBUTE = Parameter("attribute", False, "one more traced pass per engine (in its first trial, after the measured "
                                          "ones): the lines holding the peak, temporaries, diffs between engines "
                                          "(`benchlib run --attribute`)")
MODULE_DEPTH = Parameter("module_depth", DEFAULT_DEPTH, "the levels of module path memory by module keeps (a "
                         "container's index joins its container: encoder.layers.3 is two levels)", minimum=1)


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
GLOBAL_BATCH = Parameter("global_batch", "", "the parameter `--global-batch NAME=B` split over the ranks (each rank "
                         "gets B/N): set by that flag, and refused where NAME does not change the batch")
MICROBATCHES = Parameter("microbatches", TechniqueOptions.microbatches, "the parts torch-microbatch splits the batch "
                         "into, alone or combined", minimum=2)


def technique_rules(model_file, config) -> None:
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
    ranks, strategies = config.get("ranks", 1), parallel_strategies_named(config.get("parallel", ""))
    if ranks > 1 and not (strategies or placed):
        raise Refused(no_spread(ranks))
    if ranks == 1 and (strategies or placed):
        raise Refused(no_ranks(strategies or placed))
    _refuse_a_global_batch_that_is_no_batch(model_file, config.get("global_batch", ""))
    # known where a child read the file (`reading`) for ranks that will start here (a prediction starts none)
    resident = getattr(model_file, "resident_bytes", None)
    if ranks > 1 and resident:
        from benchlib.measure.ranks import refuse_crowded_cores, refuse_ranks_beyond_memory

        refuse_ranks_beyond_memory(ranks, resident)  # first: past the memory, the machine itself is at risk
        refuse_crowded_cores(ranks)


def _refuse_a_global_batch_that_is_no_batch(model_file, name: str) -> None:
    """--global-batch NAME=B splits NAME over the ranks: a NAME that leaves the batch's shapes as they are would
    split the model (its width, say), not the batch."""
    known = getattr(model_file, "batch_parameters", None)  # known where a child read the file (`reading`)
    if not name or known is None or name in known:
        return
    raise Refused(f"--global-batch {name}=...: {name} does not change the batch (batch() gives the same shapes at "
                  f"{name}={model_file.quick.get(name, model_file.parameters.get(name))} and one more), so splitting "
                  f"it over the ranks would change the model, not the batch; "
                  + (f"the parameters that change the batch: {', '.join(known)}" if known else
                     "no integer parameter of the file changes the batch"))


def file_parameters(model_file, form: Form) -> tuple[Parameter, ...]:
    """The file's own PARAMETERS, typed by their defaults, then benchlib's own (its form's)."""
    own = (TRIALS, PRECISION, _engine_choice(form), ATTRIBUTE,  # benchlib's parameters of every model file
           *((COMBINATIONS, MICROBATCHES, SAC_POLICY, MODULE_DEPTH, RANKS, PARALLEL, GLOBAL_BATCH) if form.composes else ()))
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


def file_benchmark(files: Sequence, arrays: bool, measure) -> Benchmark:
    """The benchmark of model files already read and checked, with their parameters and rules: `files` give path,
    name, parameters and quick (the files themselves, or their facts as a child that checked them reported them:
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
        parameters=file_parameters(model_file, form),
        measure=measure,
        rules=None if arrays else functools.partial(technique_rules, model_file),
    )
