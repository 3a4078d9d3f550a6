"""Engines on a model file are the same maths as eager torch on the same data and random streams, or
they say why not: stochastic steps, torch.func's limits, optimizers that couple parameters, and
checkpoints placed on the repeated blocks wherever a model keeps them."""

import torch

from benchlib.engine_names import (FUSED_OPTIMIZER, TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_FUNC, TORCH_MICROBATCH,
                                   TORCH_OFFLOAD, TORCH_SAC, TORCH_COMPILE,
                                   TORCH_COMPILE_BUDGETS)
from benchlib.engines.gradients import max_relative_error
from benchlib.measure import NotApplicable, resolve_device
from benchlib.usermodel.case import _gradient, _joint_update, case
from benchlib.engines.techniques import Step
from benchlib.engines.techniques.modules import checkpoint_params, stochastic_modules
from benchlib.usermodel.loader import read_model_file

DROPOUT = """
import torch

PARAMETERS = {"p": 0.5}

def model(p):
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(p), torch.nn.Linear(32, 1))

def batch(p):
    return torch.randn(16, 6), torch.randn(16, 1)

def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()
"""

CLIPPED = """
import torch

def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

def batch():
    return torch.randn(8, 4) * 10, torch.randn(8, 1) * 10

def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()

class ClippedSGD(torch.optim.SGD):
    def step(self, closure=None):
        parameters = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(parameters, 0.1)  # the global norm of every parameter it holds
        return super().step(closure)

def optimizer(parameters):
    return ClippedSGD(parameters, lr=0.1)
"""


def _file(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(text)
    return read_model_file(path)


def test_dropout_is_found_and_the_reference_says_its_gradient_depends_on_the_seed(tmp_path):
    cpu = resolve_device("cpu")
    for p, expected in ((0.5, 1.0), (0.0, 0.0)):
        model_file = _file(tmp_path, DROPOUT, f"dropout_{int(p * 10)}.py")
        model, _ = model_file.build({"p": p})
        assert stochastic_modules(model) == (["2"] if p else [])
        checks = case(device=cpu, path=str(model_file.path), engine=TORCH, values={"p": p},
                      gradient_dir=str(tmp_path)).check(None)
        assert checks["grad_seed_dependent"] == expected
        assert stochastic_modules(model.eval()) == []  # evaluation mode draws nothing


def test_every_engine_starts_its_checked_step_from_the_same_random_stream(tmp_path):
    """Eager torch, torch-checkpoint and fused-optimizer draw dropout's masks alike: with the same seed
    before the step their gradients agree although the step is stochastic."""
    model_file, cpu = _file(tmp_path, DROPOUT), resolve_device("cpu")
    reference, _ = _gradient(model_file, TORCH, {"p": 0.5}, cpu)
    for engine in (TORCH_CHECKPOINT,):
        gradient, _ = _gradient(model_file, engine, {"p": 0.5}, cpu)
        assert max_relative_error(gradient, reference) <= 1e-6
    again, _ = _gradient(model_file, TORCH, {"p": 0.5}, cpu, seed=123)
    assert max_relative_error(again, reference) > 1e-3  # another stream, other masks


class _Square(torch.autograd.Function):
    """An old-style autograd.Function: forward takes ctx, no setup_context (torch.func refuses it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _OldStyle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        return _Square.apply(self.linear(x))


def test_torch_func_on_an_old_style_autograd_function_is_not_applicable_with_torchs_reason():
    model, batch = _OldStyle(), (torch.randn(4, 3),)
    eager = Step(TORCH, model, batch, lambda m, x: m(x).sum(), None)
    eager()  # eager torch runs it
    step = Step(TORCH_FUNC, model, batch, lambda m, x: m(x).sum(), None)
    try:
        step()
    except NotApplicable as error:
        assert str(error).startswith("torch.func cannot transform this step: ") and "setup_context" in str(error)
    else:
        raise AssertionError("torch.func ran an autograd.Function without setup_context")


def test_an_optimizer_that_couples_parameters_gives_fused_optimizer_another_update_not_another_gradient(tmp_path):
    model_file, cpu = _file(tmp_path, CLIPPED), resolve_device("cpu")
    reference, reference_update = _gradient(model_file, TORCH, {}, cpu)
    gradient, update = _gradient(model_file, FUSED_OPTIMIZER, {}, cpu)
    assert max_relative_error(gradient, reference) <= 1e-6
    assert max_relative_error(update, reference_update) > 1e-3  # clipped per parameter instead of by the global norm
    same, same_update = _gradient(model_file, TORCH_FUNC, {}, cpu)
    assert max_relative_error(same_update, reference_update) <= 1e-6
    # the check the child makes: the file's optimizer stepped once on the same gradient, every parameter together
    joint = _joint_update(model_file, {}, cpu, gradient)
    assert max_relative_error(joint, reference_update) <= 1e-6 and max_relative_error(update, joint) > 1e-3


def test_fused_optimizer_under_autocast_is_judged_on_its_own_gradient_not_on_roundings_amplified_by_adam(tmp_path):
    # bfloat16 rounds the gradient; Adam moves an entry near zero by about lr whatever its size, so against eager
    # torch's update benchlib new's example read "differs by 2"; against the file's AdamW on the same gradient the
    # question is the regrouping alone
    model_file = _file(tmp_path, CLIPPED.replace("return ClippedSGD(parameters, lr=0.1)",
                                                 "return torch.optim.AdamW(parameters, lr=0.1)"))
    cpu = resolve_device("cpu")
    engine = f"{FUSED_OPTIMIZER}+{TORCH_AUTOCAST}"
    checks = case(device=cpu, path=str(model_file.path), engine=engine, values={},
                  gradient_dir=str(tmp_path)).check(None)
    assert checks["update_max_rel_err"] <= 1e-6


class _Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))

    def forward(self, x):
        return x + self.mlp(x)


class _Transformerish(torch.nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.embed = torch.nn.Linear(4, width)
        self.encoder = torch.nn.Module()
        self.encoder.layers = torch.nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.head(x)


class _Resnetish(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU())
        self.layer1 = torch.nn.Sequential(_Block(width), _Block(width))
        self.layer2 = torch.nn.Sequential(_Block(width), _Block(width), _Block(width))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))))


def test_torch_checkpoint_wraps_the_repeated_blocks_wherever_they_live_and_says_which(monkeypatch):
    from torch.utils import checkpoint as torch_checkpoint

    plans = {"transformer": checkpoint_params(_Transformerish()), "resnet": checkpoint_params(_Resnetish())}
    assert plans["transformer"]["checkpoint_modules"] == ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    assert plans["transformer"]["checkpoint"] == "checkpoint of each of the 3 blocks of encoder.layers (nn.ModuleList)"
    assert plans["resnet"]["checkpoint_modules"] == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]
    assert plans["resnet"]["checkpoint_segments"] == 5  # the stem (mixed) and each block's mlp are not stacks
    calls = []
    original = torch_checkpoint.checkpoint
    monkeypatch.setattr(torch_checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    for make, expected in ((_Transformerish, 3), (_Resnetish, 5)):
        gradients = {}
        for engine in (TORCH, TORCH_CHECKPOINT):
            torch.manual_seed(0)
            model, batch = make(), (torch.randn(5, 4), torch.randn(5, 1))
            step = Step(engine, model, batch, lambda m, x, y: ((m(x) - y) ** 2).mean(), None)
            captured = {}
            with step.observe(lambda name, g: captured.__setitem__(name, g.detach().clone())):
                step()
            gradients[engine] = [captured[name] for name, _ in step.named]
        assert len(calls) == expected
        calls.clear()
        assert max_relative_error(gradients[TORCH_CHECKPOINT], gradients[TORCH]) <= 1e-6


def test_the_resident_peak_decides_best_unless_it_sits_at_page_resolution():
    from benchlib.records import make_record, records_frame
    from benchlib.usermodel.summary import summary_table

    def rows(engine, peak, tracked):
        return [make_record(benchmark="m", case="step", engine=engine, device="cpu", dtype="float32", metric=metric,
                            value=value, params={"trial": trial})
                for trial in range(3) for metric, value in
                (("peak_bytes", peak), ("tracked_peak_bytes", tracked), ("time", 1e-3))]

    # the two peaks disagree on the best: above the resolution the resident one (what the process held) decides
    table = summary_table(records_frame(rows(TORCH, 8e6, 5e6) + rows(TORCH_FUNC, 6e6, 7e6)))
    lines = dict(zip(table["engine"], table["summary"]))
    assert "best by resident peak" in lines[TORCH_FUNC] and "1.33x [1.33, 1.33] the best" in lines[TORCH]
    table = summary_table(records_frame(rows(TORCH, 8e5, 5e6) + rows(TORCH_FUNC, 6e5, 7e6)))
    lines = dict(zip(table["engine"], table["summary"]))
    assert "best by tracked peak (resident < 1.000 MB: page resolution)" in lines[TORCH]
    assert all("ms [1.000 ms, 1.000 ms]/step" in line for line in lines.values())  # time with its interval


OWN_STEP = CLIPPED.replace("class ClippedSGD", "class _Unused") + """

def step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optimizer.step()
"""


def test_a_files_own_step_runs_as_written_where_it_can_and_is_not_applicable_where_it_cannot(tmp_path):
    from benchlib.usermodel.measuring import TORCH_FORM
    from benchlib.usermodel.loader import check_form

    model_file, cpu = _file(tmp_path, OWN_STEP.replace("return ClippedSGD(", "return torch.optim.SGD(")), \
        resolve_device("cpu")
    check_form(model_file, {})
    plan = TORCH_FORM.facts(model_file, {}, cpu, TORCH_FORM.engines, {})
    # the engines that change only what the forward saves run the file's step as written (offload: CUDA only)
    assert set(plan.reasons) == {TORCH_FUNC, FUSED_OPTIMIZER, TORCH_AUTOCAST, TORCH_MICROBATCH, TORCH_OFFLOAD,
                                 TORCH_COMPILE, *TORCH_COMPILE_BUDGETS}
    for engine in (TORCH_FUNC, FUSED_OPTIMIZER, TORCH_MICROBATCH):
        assert "the file's step(model, optimizer, *batch) runs its own forward and backward" in plan.reasons[engine]
    sac, _ = _gradient(model_file, TORCH_SAC, {}, cpu)
    assert max_relative_error(sac, _gradient(model_file, TORCH, {}, cpu)[0]) <= 1e-6
    reference, reference_update = _gradient(model_file, TORCH, {}, cpu)
    gradient, update = _gradient(model_file, TORCH_CHECKPOINT, {}, cpu)
    assert max_relative_error(gradient, reference) <= 1e-6 and max_relative_error(update, reference_update) <= 1e-6
    # the step as written: clipped by the global norm to 0.1, so the update is lr * 0.1 at most in norm
    norm = torch.sqrt(sum((u ** 2).sum() for u in reference_update))
    assert float(norm) <= 0.1 * 0.1 + 1e-6


def test_fused_optimizers_reason_names_parameter_groups_as_well_as_coupling():
    from benchlib.engines.techniques import combine, technique_registry

    reason = combine(FUSED_OPTIMIZER, technique_registry()).regroups_optimizer
    assert "couples them (clipping by their global norm)" in reason
    assert "parameter groups with their own settings" in reason  # SGD groups: not named clipping alone
