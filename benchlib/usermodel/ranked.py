"""One rank's share of a model file's step on several torch.distributed ranks, set up in that rank's process.

Every rank runs this target at once (`benchlib.measure.run_ranks`): it joins the group, has the
combination's parallel strategy place the seeded model (`Technique.place`), draws its own batch (rank r
from its own seed, so the global batch is the file's batch times the ranks), and measures its step as any
case is measured. Its check makes the same extra steps as one process's: memory by role and by module on
this rank (a sharded tensor counted by its local shard; under FSDP, the parameters gathered whole as its
blocks run, a role of their own), then the gradient on a freshly placed model,
gathered whole on every rank, and one step under torch.profiler for the share of its time spent in collectives.
Rank 0 judges the gradient against what data parallelism must compute: eager torch in this one process,
the mean of the gradients of every rank's batch from the same random streams.
"""

from __future__ import annotations

from benchlib.engines.gradients import GRAD_ERROR_METRIC, WORST_ARRAY_METRIC, array_floor, max_relative_error, \
    require_finite
from benchlib.engines.module_memory import DEFAULT_DEPTH
from benchlib.engines.techniques import REFERENCE, Step, TechniqueOptions
from benchlib.engines.techniques.parallel import GatheredBytes, RankGroup, communication_share, gathered
from benchlib.measure import Case
from benchlib.records.metrics import COMMUNICATION_METRIC, GATHERED_METRIC
from benchlib.usermodel.case import STEP_SEED, combination_of, memory_by_role
from benchlib.usermodel.loader import ModelFile, guarded, read_model_file


def _placed_step(model_file: ModelFile, engine: str, values: dict, device, rank: int, options: dict | None) -> Step:
    combination = combination_of(model_file, engine, options)
    model = combination.place(lambda: model_file.seeded_model(values), device.torch)
    return Step(combination, model, model_file.seeded_batch(values, device.torch, rank), model_file.loss,
                model_file.optimizer_at(values), model_file.step, TechniqueOptions.from_json(options))


def _gathered_gradient(step: Step, rank: int) -> list:
    """The gradient this rank's step leaves, every array gathered whole, in the order of named_parameters."""
    import torch

    captured = {}
    torch.manual_seed(STEP_SEED + rank)
    with step.observe(lambda name, gradient: captured.__setitem__(name, gradient.detach())):
        step()
    return [gathered(captured[name]).cpu().clone() for name, _ in step.named]


def _data_parallel_gradient(model_file: ModelFile, values: dict, device, world_size: int) -> list:
    """Eager torch's gradient in one process, averaged over every rank's batch, each from its rank's random stream."""
    import torch

    total = None
    for rank in range(world_size):
        model, batch = model_file.seeded_model(values).to(device.torch), model_file.seeded_batch(values, device.torch, rank)
        step = Step(REFERENCE, model, batch, model_file.loss, model_file.optimizer_at(values), model_file.step)
        captured = {}
        torch.manual_seed(STEP_SEED + rank)
        with step.observe(lambda name, gradient: captured.__setitem__(name, gradient.detach().cpu().clone())):
            step()
        arrays = [captured[name] for name, _ in step.named]
        total = arrays if total is None else [a + b for a, b in zip(total, arrays)]
    return [array / world_size for array in total]


def _gradient_errors(model_file: ModelFile, engine: str, values: dict, device, group: RankGroup,
                     options: dict | None) -> dict[str, float]:
    fresh = _placed_step(model_file, engine, values, device, group.rank, options)
    gradient = _gathered_gradient(fresh, group.rank)
    require_finite(gradient, [name for name, _ in fresh.named])
    if group.rank != 0:
        return {}
    want = _data_parallel_gradient(model_file, values, device, group.world_size)
    floor = array_floor(str(want[0].dtype).removeprefix("torch.")) if want else None
    return {GRAD_ERROR_METRIC: max_relative_error(gradient, want),
            **({WORST_ARRAY_METRIC: max_relative_error(gradient, want, floor=floor)} if floor is not None else {})}


def case(*, device, path: str, engine: str, values: dict, group: dict, options: dict | None = None,
         module_depth: int = DEFAULT_DEPTH, checked: bool = True) -> Case:
    """One rank's step of `engine` (a combination with a parallel strategy); `group`: a `RankGroup`'s fields. Without
    `checked` (`benchlib fit`, which asks only what the steps hold), no check runs after the measured steps: its
    extra steps (a second placed model, rank 0's whole-model reference) would outgrow the process the question is
    about, and a confirming process is ended past its cap whenever it reaches it."""
    model_file = read_model_file(path)
    group = RankGroup(**group)
    group.join(device.torch)
    step = guarded(model_file, f"{engine}'s set-up (placing the model)", _placed_step, model_file, engine, values,
                   device, group.rank, options)
    what = f"the {engine} step on rank {group.rank}"
    by_module: list[dict] = []

    def check(_result) -> dict[str, float]:
        with GatheredBytes().watching() as gathered_bytes:
            roles, by_module[:] = guarded(model_file, what, memory_by_role, step, module_depth)
        if gathered_bytes.seen:  # a sharded step: what its blocks held gathered whole
            roles[GATHERED_METRIC] = float(gathered_bytes.peak)
        roles.update(guarded(model_file, what, _gradient_errors, model_file, engine, values, device, group, options))
        roles[COMMUNICATION_METRIC] = guarded(model_file, what, communication_share, step)
        return roles

    return Case(lambda: guarded(model_file, what, step), check if checked else None, breakdown=lambda: by_module)
