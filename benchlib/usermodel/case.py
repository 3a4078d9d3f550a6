"""One engine's step of a model file, set up in the isolation child (`run_isolated`'s target).

The child re-reads the file (JSON crosses the process boundary, never the user's objects), builds
the seeded model and batch, and measures the step. The check then makes two more steps outside the
measured ones: one on the measured model under saved-tensor hooks and a gradient counter (memory by
role), and one on a fresh seeded model to save the gradient the step computes (the parent compares
it with eager torch's). With `check="categories"` (`--attribute`) one more step runs under torch.profiler:
torch's own memory categories at its peak, beside the roles; with `check="none"` (`benchlib fit`) no check
runs. An exception in the user's code names
the file's line that raised it.
"""

from __future__ import annotations

from typing import Any

from benchlib.errors import Refused
from benchlib.engines.gradients import (SEED_DEPENDENT_METRIC, UPDATE_ERROR_METRIC, gradient_tolerance,
                                        max_relative_error, require_finite, save_gradient)
from benchlib.analysis.module_paths import COMPILED, NO_MODULE
from benchlib.engines.module_memory import DEFAULT_DEPTH, ModulePaths, held_by_module, module_rows
from benchlib.engines.techniques.parallel import unwrapped
from benchlib.engines.roles import GRADIENT_METRIC, OPTIMIZER_METRIC, PARAMETER_METRIC, SAVED_METRIC, LiveBytes, SavedTensors
from benchlib.engines.techniques import REFERENCE, Aspect, Combination, Step, TechniqueOptions, combine, technique_registry
from benchlib.measure import Case
from benchlib.measure.torch_categories import torch_categories
from benchlib.records.metrics import COMPILE_METRIC, GRADIENT_ROLE, OPTIMIZER_ROLE, PARAMETER_ROLE, SAVED_ROLE
from benchlib.usermodel.loader import SEED, ModelFile, guarded, read_model_file

# What runs after the measured steps: nothing (`benchlib fit`, which asks only what the steps hold: the check's extra
# steps would cost time for a result nobody reads, and a confirming process is ended past its cap whenever it reaches
# it), the roles and the gradient check (`run`), or torch's memory categories besides (`run --attribute`).
CHECKS = ("none", "gradient", "categories")
STEP_SEED = SEED + 2  # the random stream every engine's checked step starts from (dropout masks alike)

# A step that replaces the file's optimizer step (`Technique.regroups_optimizer`: fused-optimizer, alone or joined)
# has its update judged against the file's own optimizer stepped once on the same gradient, in the child: the
# question is whether regrouping changed the step, and any other part's rounding (bfloat16 under autocast) is in
# both. Against eager torch's update it would be judged by rounding: optimizers that normalise each entry (Adam)
# move an entry near zero by up to 2 lr when its rounding changes. Every other engine steps the file's own
# optimizer on the gradient it computed, which is checked already, so its update adds no check.
CASE_METRICS = (  # what a model file's case records beyond the shared metrics
    (PARAMETER_METRIC, "B", "memory", "the model's parameters (held before every step: in the baseline, not the peak)"),
    (OPTIMIZER_METRIC, "B", "memory", "the optimizer's state (held before every step: in the baseline, not the peak)"),
)


def memory_by_role(step: Step, depth: int) -> tuple[dict[str, float], list[dict]]:
    """Memory by role in one more step: parameters and optimizer state as held, gradients and (for the
    engines that differentiate with torch.autograd) saved activations at their most; and the same bytes by
    module path (`module_memory`), each role's at its own most, so a role's modules sum to its total."""
    import torch

    paths = ModulePaths(unwrapped(step.model), depth, outside=NO_MODULE if step.compile_s is None else COMPILED)
    owners = {name: paths.parameter_owner(p) for name, p in step.named}
    gradients = LiveBytes(where=owners.__getitem__)
    state = [(paths.parameter_owner(parameter), value) for optimizer in step.optimizers
             for parameter, values in optimizer.state.items() for value in values.values()
             if isinstance(value, torch.Tensor)]
    by_module = {PARAMETER_ROLE: held_by_module((owners[name], p) for name, p in step.named),
                 OPTIMIZER_ROLE: held_by_module(state)}
    roles = {PARAMETER_METRIC: float(sum(by_module[PARAMETER_ROLE].values())),
             OPTIMIZER_METRIC: float(sum(by_module[OPTIMIZER_ROLE].values()))}
    if step.combination.hides_saved:  # what its backward saves is out of our hooks' sight (torch.func, offload)
        with step.observe(gradients.add):
            step()
        by_module[GRADIENT_ROLE] = gradients.places.peak
        return {**roles, GRADIENT_METRIC: float(gradients.peak_bytes)}, module_rows(by_module, depth)
    sharded = step.combination.owner(Aspect.PLACEMENT) is not None  # a parameter gathered for a block's forward
    saved = SavedTensors(inputs=(*step.batch, *(p for _, p in step.named)), where=paths.innermost,
                         parameters=step.model.parameters if sharded else None)
    with paths.tracking(), saved, step.observe(gradients.add):
        step()
    by_module.update({GRADIENT_ROLE: gradients.places.peak, SAVED_ROLE: saved.places.peak})
    return ({**roles, GRADIENT_METRIC: float(gradients.peak_bytes), SAVED_METRIC: float(saved.peak_bytes)},
            module_rows(by_module, depth))


def combination_of(model_file: ModelFile, engine: str, options: dict | None = None) -> Combination:
    """The techniques `engine` names (one, or several joined by `+`), the file's own among them."""
    return combine(engine, technique_registry(model_file.techniques), TechniqueOptions.from_json(options))


def make_step(model_file: ModelFile, engine: str, values: dict, model, batch, options: dict | None = None) -> Step:
    """`engine`'s step over `model` and `batch`, built at `values`."""
    return Step(combination_of(model_file, engine, options), model, batch, model_file.loss, model_file.optimizer_at(values),
                model_file.step)


def _gradient(model_file: ModelFile, engine: str, values: dict, device: Any, seed: int = STEP_SEED,
              options: dict | None = None) -> tuple[list, list | None]:
    """The gradient `engine`'s step computes on a fresh seeded model, in the order of named_parameters,
    its random stream seeded with `seed` first, so engines that draw alike draw the same numbers; and,
    when the file has an optimizer, the update its step made to the parameters (after minus before; None
    without one). The update, not the parameters, is compared: a small learning rate would otherwise hide
    any difference under the parameters' own size."""
    import torch

    model, batch = model_file.build(values, device.torch)
    step = make_step(model_file, engine, values, model, batch, options)
    captured = {}
    before = [p.detach().cpu().clone() for _, p in step.named]
    torch.manual_seed(seed)
    with step.observe(lambda name, gradient: captured.__setitem__(name, gradient.detach().cpu().clone())):
        step()
    update = ([p.detach().cpu() - old for (_, p), old in zip(step.named, before)]
              if model_file.optimizer is not None else None)
    return [captured[name] for name, _ in step.named], update


def _joint_update(model_file: ModelFile, values: dict, device: Any, gradient: list) -> list:
    """The update the file's own optimizer makes from `gradient`, stepped once over every parameter together
    on a fresh seeded model: what a step that regroups the optimizer must reproduce."""
    model, _ = model_file.build(values, device.torch)
    named = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().cpu().clone() for p in named]
    for p, g in zip(named, gradient):
        p.grad = g.to(device=p.device, dtype=p.dtype)
    model_file.optimizer_at(values)(named).step()
    return [p.detach().cpu() - old for p, old in zip(named, before)]


def _seed_dependent(model_file: ModelFile, values: dict, device: Any, gradient: list) -> float:
    """1 when the reference's gradient under another seed differs beyond its tolerance (the step draws
    random numbers), else 0: what tells "not comparable" from "not the same maths"."""
    again, _ = _gradient(model_file, REFERENCE, values, device, seed=STEP_SEED + 1)
    tolerance = gradient_tolerance(str(gradient[0].dtype).removeprefix("torch.")) if gradient else None
    return float(bool(gradient) and not max_relative_error(again, gradient) <= (tolerance or 0.0))


def case(*, device, path: str, engine: str, values: dict, gradient_dir: str, check: str = "gradient",
         options: dict | None = None, module_depth: int = DEFAULT_DEPTH) -> Case:
    """`engine`: a technique, or several joined by `+`; `options`: the run's technique settings
    (`measuring.technique_options`: micro-batches, the SAC policy); `module_depth`: the levels of module
    paths its memory by module keeps; `check`: what runs after the measured steps (`CHECKS`)."""
    if check not in CHECKS:
        raise Refused(f"check={check!r}: valid values are {', '.join(CHECKS)}")
    model_file = read_model_file(path)
    model, batch = guarded(model_file, "model or batch (building the case)", model_file.build, values, device.torch)
    step = guarded(model_file, f"{engine}'s set-up (optimizer)", make_step, model_file, engine, values, model, batch, options)
    what = f"the {engine} step"
    regroups = step.combination.regroups_optimizer is not None and model_file.optimizer is not None
    by_module: list[dict] = []

    def checked(_result) -> dict[str, float]:
        roles, by_module[:] = guarded(model_file, what, memory_by_role, step, module_depth)
        if step.compile_s is not None:
            roles[COMPILE_METRIC] = step.compile_s
        gradient, update = guarded(model_file, what, _gradient, model_file, engine, values, device, STEP_SEED,
                                   options)
        require_finite(gradient, [name for name, _ in step.named])  # a NaN step fails, never passes unnoticed
        save_gradient(gradient, gradient_dir, engine)
        if regroups:
            require_finite(update, [name for name, _ in step.named])
            joint = guarded(model_file, what, _joint_update, model_file, values, device, gradient)
            roles[UPDATE_ERROR_METRIC] = max_relative_error(update, joint)
        if engine == REFERENCE:
            roles[SEED_DEPENDENT_METRIC] = guarded(model_file, what, _seed_dependent, model_file, values, device,
                                                   gradient)
        if check == "categories":  # torch's own view of one more step, beside the roles (`--attribute`)
            roles.update(guarded(model_file, what, torch_categories, step, device.name))
        return roles

    return Case(lambda: guarded(model_file, what, step), None if check == "none" else checked,
                breakdown=lambda: by_module)
