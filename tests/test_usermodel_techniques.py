"""The memory techniques as model-file engines: each computes eager torch's gradient (within its dtype's
tolerance), and says why where it cannot apply, before any step is measured."""

import pytest
import torch
from torch import nn

from benchlib.engine_names import (FUSED_OPTIMIZER, TORCH, TORCH_AUTOCAST, TORCH_CHECKPOINT, TORCH_COMPILE,
                                   TORCH_COMPILE_BUDGETS, TORCH_FUNC, TORCH_MICROBATCH, TORCH_OFFLOAD, TORCH_SAC)
from benchlib.engines import compiling
from benchlib.engines.gradients import gradient_tolerance, max_relative_error
from benchlib.measure.case_child import NotApplicable
from benchlib.engines import AUTOCAST_DTYPE
from benchlib.engines.namespaces import SAC_SAVED_OPS
from benchlib.engines.techniques import Step, StepFacts, TechniqueOptions, combine, technique_registry
from benchlib.engines.techniques.modules import microbatch_scale, split_batch

MICROBATCHES = TechniqueOptions.microbatches


def not_applicable(engine, model, has_optimizer, has_step=False, device_kind="cpu"):
    """Why `engine` cannot run `model`'s step, as a run's plan asks it."""
    return combine(engine, technique_registry()).not_applicable(model, StepFacts(has_optimizer, has_step, device_kind))


def blocks(depth=4, width=16, norm=None, dtype=torch.float32):
    torch.manual_seed(0)
    layers = [nn.Linear(8, width)]
    layers += [nn.Sequential(nn.Linear(width, width), nn.GELU(), norm(width) if norm else nn.Identity())
               for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 3)).to(dtype)


def data(n=12, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=generator, dtype=dtype), torch.randint(0, 3, (n,), generator=generator)


def mean_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def sum_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def gradient(engine, loss=mean_loss, model=None, batch=None):
    step = Step(engine, model or blocks(), batch or data(), loss, None)
    captured = {}
    with step.observe(lambda name, g: captured.__setitem__(name, g.detach().clone())):
        step()
    return [captured[name] for name, _ in step.named]


@pytest.mark.parametrize("engine", [TORCH_SAC, TORCH_MICROBATCH, TORCH_CHECKPOINT])
@pytest.mark.parametrize("loss", [mean_loss, sum_loss])
def test_recomputing_and_microbatching_engines_compute_eager_torchs_gradient(engine, loss):
    assert max_relative_error(gradient(engine, loss), gradient(TORCH, loss)) <= gradient_tolerance("float32")


def test_autocast_computes_the_gradient_within_bfloat16s_tolerance_and_not_exactly():
    error = max_relative_error(gradient(TORCH_AUTOCAST), gradient(TORCH))
    assert 0 < error <= gradient_tolerance(AUTOCAST_DTYPE)


def test_each_micro_batch_loss_is_scaled_to_the_full_batchs_reduction():
    model, batch = blocks(), data()
    chunks = split_batch(batch, MICROBATCHES)
    assert [chunk[0].shape[0] for chunk in chunks] == [3] * MICROBATCHES
    assert microbatch_scale(model, mean_loss, batch, chunks) == 1 / MICROBATCHES
    assert microbatch_scale(model, sum_loss, batch, chunks) == 1.0
    before = torch.get_rng_state()
    norm = blocks(norm=nn.BatchNorm1d)
    running = norm[1][2].running_mean.clone()
    with pytest.raises(NotApplicable, match="neither the mean .* nor the sum .* statistics of the whole batch"):
        microbatch_scale(norm, mean_loss, batch, chunks)
    assert torch.equal(norm[1][2].running_mean, running) and torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("n, message", [(10, "10 samples does not split into 4 equal"), (2, "2 samples")])
def test_a_batch_that_does_not_split_evenly_is_not_applicable(n, message):
    with pytest.raises(NotApplicable, match=message):
        Step(TORCH_MICROBATCH, blocks(), data(n), mean_loss, None)


def test_where_a_technique_cannot_apply_it_says_why():
    model = blocks()
    assert "already live on the host" in not_applicable(TORCH_OFFLOAD, model, False, device_kind="cpu")
    assert not_applicable(TORCH_OFFLOAD, model, False, device_kind="cuda") is None
    assert "parameters are float64" in not_applicable(TORCH_AUTOCAST, blocks(dtype=torch.float64), False)
    for engine in (TORCH_AUTOCAST, TORCH_MICROBATCH, TORCH_COMPILE):
        assert "runs its own forward and backward" in not_applicable(engine, model, True, has_step=True)
    assert not_applicable(TORCH_SAC, model, True, has_step=True) is None  # it changes only what forward saves
    assert "nothing to checkpoint" in not_applicable(TORCH_SAC, nn.Linear(2, 2), False)


def test_a_sac_policy_saves_the_ops_it_names_and_computes_the_same_gradient():
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Recomputed(TorchDispatchMode):
        """The aten ops backward runs: a forward op among them was recomputed, not saved."""

        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def backward_ops(saved_ops):
        step = Step(TORCH_SAC, blocks(), data(), mean_loss, None, options=TechniqueOptions(sac_saved_ops=saved_ops))
        loss = mean_loss(step.model, *step.batch)
        with Recomputed() as recomputed:
            loss.backward()
        return recomputed.ops, [p.grad.clone() for _, p in step.named]

    default, default_gradient = backward_ops(SAC_SAVED_OPS)
    gelu_only, gelu_gradient = backward_ops(("gelu",))
    assert default["addmm"] == 0 and default["gelu"] > 0  # matrix products saved, activations recomputed
    assert gelu_only["addmm"] > 0 and gelu_only["gelu"] == 0  # the other way round
    assert max_relative_error(gelu_gradient, default_gradient) <= gradient_tolerance("float32")


def test_a_sac_policy_naming_no_aten_op_is_refused_before_any_case(tmp_path):
    import textwrap

    from benchlib.benchmark import ParameterError
    from benchlib.usermodel import load_model_file
    from test_usermodel import GOOD

    (tmp_path / "model.py").write_text(textwrap.dedent(GOOD))
    benchmark = load_model_file(tmp_path / "model.py")
    assert benchmark.config({"sac_saved_ops": ("mm", "gelu")})["sac_saved_ops"] == ("mm", "gelu")
    with pytest.raises((ValueError, ParameterError), match="'matmull' is no op of torch.ops.aten; valid: aten op"):
        benchmark.config({"sac_saved_ops": ("mm", "matmull")})


def test_compile_happens_in_the_set_up_and_never_in_a_step(counting_backend):
    step = Step(TORCH_COMPILE, blocks(), data(), mean_loss, lambda parameters: torch.optim.SGD(parameters, lr=0.1))
    compiled = counting_backend.graphs
    assert compiled >= 1 and step.compile_s > 0
    assert all(p.grad is None for _, p in step.named)  # the compiling call's gradients are not left for the step
    for _ in range(3):
        step()
    assert counting_backend.graphs == compiled


def test_compile_computes_eager_torchs_gradient(counting_backend):
    assert max_relative_error(gradient(TORCH_COMPILE), gradient(TORCH)) <= gradient_tolerance("float32")


def test_a_compiler_failure_is_not_applicable_and_the_files_own_error_stays_its_own(monkeypatch, counting_backend):
    import torch._dynamo
    from torch._dynamo.exc import BackendCompilerFailed

    def failing(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiling, "COMPILE_BACKEND", failing)
    with pytest.raises(NotApplicable, match="torch.compile could not compile this step: BackendCompilerFailed"):
        Step(TORCH_COMPILE, blocks(), data(), mean_loss, None)
    assert issubclass(BackendCompilerFailed, torch._dynamo.exc.TorchDynamoException)

    def wrong(model, x, y):
        return nn.functional.cross_entropy(model(x[:, :5]), y)  # a shape error of the file's own

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "COMPILE_BACKEND", counting_backend)
    with pytest.raises(Exception) as raised:
        Step(TORCH_COMPILE, blocks(), data(), wrong, None)
    assert not isinstance(raised.value, NotApplicable)


@pytest.mark.parametrize("budget_engine", list(TORCH_COMPILE_BUDGETS))
def test_a_lower_activation_budget_saves_fewer_bytes_for_the_same_gradient(budget_engine, monkeypatch):
    import torch._dynamo

    from benchlib.engines.roles import SavedTensors

    # the partitioner the budget steers, without a C++ compiler: the graphs run as aten ops
    monkeypatch.setattr(compiling, "COMPILE_BACKEND", "aot_eager_decomp_partition")

    def saved_and_gradient(engine):
        torch._dynamo.reset()  # one process measures one engine; here each compiles afresh
        step = Step(engine, blocks(depth=3, width=64), data(n=32), mean_loss, None)
        saved = SavedTensors(inputs=(*step.batch, *(p for _, p in step.named)))
        with saved:
            step()
        return saved.peak_bytes, gradient(engine)

    try:
        (full, full_gradient), (budgeted, budgeted_gradient) = map(saved_and_gradient, (TORCH_COMPILE, budget_engine))
    finally:
        torch._dynamo.reset()
    assert budgeted < full  # here 57,732 B at the default budget; 24,964, 388 and 0 at 0.5, 0.1 and 0
    assert max_relative_error(budgeted_gradient, gradient(TORCH)) <= gradient_tolerance("float32")
    assert max_relative_error(full_gradient, gradient(TORCH)) <= gradient_tolerance("float32")


@pytest.mark.slow
def test_a_run_of_the_techniques_records_each_checked_or_not_applicable_and_ends_with_the_frontier(tmp_path, capsys):
    import json
    import textwrap

    from benchlib.records import load_records
    from benchlib.runner.cli import main
    from test_usermodel import GOOD, OPTIMIZER

    (tmp_path / "model.py").write_text(textwrap.dedent(GOOD + OPTIMIZER))
    engines = "torch,torch-sac,torch-autocast,torch-microbatch,torch-offload,torch.compile"
    assert main(["run", str(tmp_path / "model.py"), "--quick", "-p", "n=8", "-p", f"engines={engines}",
                 "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    records = load_records(next((tmp_path / "out").iterdir()))
    measured = set(records[records["metric"] == "time"]["variant"])
    assert measured == {TORCH, TORCH_SAC, TORCH_AUTOCAST, TORCH_MICROBATCH, TORCH_COMPILE}
    compile_times = records[records["metric"] == "compile_time"]
    assert set(compile_times["variant"]) == {TORCH_COMPILE} and len(compile_times) == 2  # one per trial, apart
    (offload,) = records[records["metric"] == "not_applicable"].itertuples()
    assert offload.variant == TORCH_OFFLOAD and "already live on the host" in json.loads(offload.params)["message"]
    assert set(records[records["variant"] == TORCH_AUTOCAST]["dtype"]) == {AUTOCAST_DTYPE}
    errors = records[records["metric"] == "grad_max_rel_err"].set_index("variant")["value"]
    assert (errors[[TORCH_SAC, TORCH_MICROBATCH, TORCH_COMPILE]] <= gradient_tolerance("float32")).all()
    assert (errors[TORCH_AUTOCAST] <= gradient_tolerance(AUTOCAST_DTYPE)).all()
    # only an engine that replaces the file's optimizer step has its update compared: these step the file's own
    assert records[records["metric"] == "update_max_rel_err"].empty
    printed = capsys.readouterr().out
    assert "fastest within a memory level" in printed


IMPORTS_CHILD = """
import os, sys, json
import torch
import benchlib.usermodel.case as case_module
from benchlib.measure import resolve_device
path, gradients = sys.argv[1], sys.argv[2]
for engine in sys.argv[3:]:
    pid = os.fork()
    if pid == 0:
        case = case_module.case(device=resolve_device("cpu"), path=path, engine=engine, values={}, gradient_dir=gradients)
        case.fn()
        print(json.dumps([engine, "torch._dynamo" in sys.modules]), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("has_optimizer", [False, True])
def test_a_template_preloads_torch_dynamo_exactly_for_the_steps_that_import_it(tmp_path, has_optimizer):
    # What a fork template preloads must be what the case would import anyway: more would put objects in its
    # heap that a user's process has not, less leaves 0.8 s of import in every trial's set-up
    import json
    import subprocess
    import sys

    def step_imports(engine, has_optimizer):
        return combine(engine, technique_registry()).imports(has_optimizer)

    path = tmp_path / "model.py"
    path.write_text("import torch\n\ndef model():\n    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))"
                    "\n\ndef batch():\n    return (torch.randn(8, 4),)\n\ndef loss(model, x):\n    return model(x).square().mean()\n"
                    + ("\ndef optimizer(parameters):\n    return torch.optim.SGD(parameters, lr=0.1)\n" if has_optimizer else ""))
    engines = [TORCH, TORCH_FUNC, TORCH_CHECKPOINT, TORCH_SAC, TORCH_AUTOCAST, TORCH_MICROBATCH]
    engines += [FUSED_OPTIMIZER] if has_optimizer else []
    out = subprocess.run([sys.executable, "-c", IMPORTS_CHILD, str(path), str(tmp_path), *engines],
                         capture_output=True, text=True, check=True).stdout
    imported = dict(json.loads(line) for line in out.splitlines())
    assert imported == {engine: step_imports(engine, has_optimizer) == ("torch._dynamo",) for engine in engines}
    assert any(imported.values()) and (has_optimizer or not all(imported.values()))


def test_a_non_finite_loss_leaves_micro_batches_to_fail_as_every_engine_does_not_to_be_called_batch_statistics():
    import torch


    model = torch.nn.Linear(3, 1)
    batch = (torch.randn(8, 3),)
    chunks = [tuple(part) for part in zip(*(tensor.chunk(4) for tensor in batch))]
    nan_loss = lambda model, x: model(x).sum() * float("nan")  # noqa: E731
    assert microbatch_scale(model, nan_loss, batch, chunks) == 0.25  # before: "not applicable: ... (nan) is neither the mean"
    assert microbatch_scale(model, lambda model, x: model(x).mean(), batch, chunks) == 0.25
    assert microbatch_scale(model, lambda model, x: model(x).sum(), batch, chunks) == 1.0


def test_micro_batches_apply_to_a_block_that_drops_out_inside_its_own_kernel():
    # transformers' attention passes its dropout probability to scaled_dot_product_attention while it is in
    # training mode: no dropout module to turn off, so the scale check quiets every module but batch norms
    class KernelDropout(nn.Module):
        def forward(self, x):
            return nn.functional.dropout(x, 0.5, self.training)

    model = nn.Sequential(nn.Linear(8, 16), KernelDropout(), nn.Linear(16, 3))
    batch = data(12)
    assert microbatch_scale(model, mean_loss, batch, split_batch(batch, 4)) == 0.25
    assert all(module.training for module in model.modules())  # left as it was
    norm = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), KernelDropout(), nn.Linear(16, 3))
    with pytest.raises(NotApplicable, match="statistics of the whole batch"):
        microbatch_scale(norm, mean_loss, batch, split_batch(batch, 4))
