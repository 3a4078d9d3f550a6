"""Steps on several torch.distributed ranks (gloo on the CPU): each rank's roles are its shard's, the gathered
gradient is what data parallelism must compute (and a step that does not reduce is caught), a rank that dies
ends the step and is named, and bad settings are refused before any work."""

import json
import textwrap

import pandas as pd
import pytest

from benchlib.engines.gradients import gradient_tolerance
from benchlib.measure import IsolatedResult, Measurement, RankedResult
from benchlib.records import load_records
from benchlib.runner.cli import main

MODEL = """
import torch
from torch import nn

NAME = "ranked_stack"
PARAMETERS = {"width": 32, "depth": 4}

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))

def model(width, depth):
    return nn.Sequential(nn.Linear(6, width), nn.Sequential(*[Block(width) for _ in range(depth)]), nn.Linear(width, 2))

def batch(width, depth):
    return torch.randn(8, 6), torch.randint(0, 2, (8,))

def loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)

def optimizer(parameters):
    return torch.optim.Adam(parameters, lr=1e-3)
"""

# A placement of the file's own that never reduces: each rank keeps its own batch's gradient
NO_REDUCTION = """
from benchlib.engines.techniques import Aspect, Need, Technique

class Alone(Technique):
    changes = frozenset({Aspect.PLACEMENT})
    needs = frozenset({Need.RANKS})
    runs_file_step = True

TECHNIQUES = {"alone": Alone}
"""

DIES = """
import os

def loss(model, x, y):
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() == 1:
        os._exit(1)
    return nn.functional.cross_entropy(model(x), y)
"""


def _run(tmp_path, source: str, *args: str) -> tuple[int, pd.DataFrame]:
    (tmp_path / "model.py").write_text(textwrap.dedent(source))
    code = main(["run", str(tmp_path / "model.py"), "-p", "trials=1", "--device", "cpu",
                 "--out", str(tmp_path / "out"), *args])
    runs = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    return code, (load_records(runs[0]) if runs else pd.DataFrame())


def _value(records: pd.DataFrame, engine: str, metric: str, **params) -> list[float]:
    rows = records[(records["variant"] == engine) & (records["metric"] == metric)]
    if rows.empty:
        return []
    keep = rows["params"].map(lambda text: all(json.loads(text).get(k) == v for k, v in params.items()))
    return list(rows[keep.astype(bool)]["value"])


@pytest.mark.slow
def test_fsdp_holds_half_of_every_held_role_per_rank_and_both_strategies_compute_the_same_gradient(tmp_path):
    code, records = _run(tmp_path, MODEL, "--ranks", "2", "--parallel", "ddp,fsdp")
    assert code == 0
    for role in ("role_parameter_bytes", "role_optimizer_bytes", "role_gradient_bytes"):
        (whole,) = _value(records, "torch", role)
        for rank in (0, 1):  # every width is even: each shard is exactly half, byte for byte; Adam's step counts
            # (a scalar per parameter) are every rank's own
            (shard,) = _value(records, "fsdp", f"rank_{role}", rank=rank, world_size=2)
            assert shard == whole / 2 if role != "role_optimizer_bytes" else abs(shard - whole / 2) <= 0.01 * whole
            assert _value(records, "ddp", f"rank_{role}", rank=rank, world_size=2) == [whole]
    for engine in ("ddp", "fsdp"):
        (error,) = _value(records, engine, "grad_max_rel_err")
        assert error <= gradient_tolerance("float32")
        (peak,) = records[(records["variant"] == engine) & (records["metric"] == "peak_bytes")].itertuples()
        assert json.loads(peak.params)["world_size"] == 2 and json.loads(peak.params)["worst_rank"] in (0, 1)
    saved = _value(records, "fsdp", "rank_role_saved_bytes", rank=0)  # gathered parameters are no activations
    assert saved == _value(records, "torch", "role_saved_bytes")
    # each rank gathers blocks whole as they run: at least one block's parameters (fc and norm: (w + 3) w floats),
    # never more than the whole model's; a rank of DDP gathers nothing
    (whole,) = _value(records, "torch", "role_parameter_bytes")
    gathered = [_value(records, "fsdp", "rank_role_gathered_bytes", rank=rank)[0] for rank in (0, 1)]
    assert gathered[0] == gathered[1] and 4 * (32 + 3) * 32 <= gathered[0] <= whole
    assert not _value(records, "ddp", "rank_role_gathered_bytes", rank=0)


@pytest.mark.slow
def test_a_placement_that_never_reduces_fails_the_gradient_check(tmp_path):
    code, records = _run(tmp_path, MODEL + NO_REDUCTION, "--ranks", "2", "-p", "engines=alone")
    assert code == 1
    (failed,) = records[(records["variant"] == "alone") & (records["metric"] == "failed")].itertuples()
    assert "not the same maths" in json.loads(failed.params)["message"]


@pytest.mark.slow
def test_a_rank_that_exits_mid_step_ends_the_step_and_is_named(tmp_path):
    code, records = _run(tmp_path, MODEL + DIES, "--ranks", "2", "--parallel", "fsdp", "--timeout", "120")
    assert code == 1
    (failed,) = records[(records["variant"] == "fsdp") & (records["metric"] == "failed")].itertuples()
    message = json.loads(failed.params)["message"]
    assert "rank 1 of 2 failed first" in message and "exited with status 1" in message
    assert "rank 0: its collective lost rank 1" in message


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (("--ranks", "2"), "say how the step is spread"),
    (("--parallel", "fsdp"), "give --ranks N"),
    (("--ranks", "2", "--parallel", "zero3"), "'zero3' is no parallel strategy; valid: ddp, fsdp"),
    (("-p", "engines=fsdp+ddp", "--ranks", "2"), "both change where the parameters live"),
    (("--ranks", "100000", "--parallel", "ddp"), "ranks=100000 needs at least"),  # no machine holds 10^5 torch processes
])
def test_bad_rank_settings_are_refused_before_any_work(tmp_path, capsys, args, words):
    code, records = _run(tmp_path, MODEL, *args)
    assert code == 2 and records.empty
    assert words in capsys.readouterr().err


def test_ranks_beyond_the_memory_free_are_refused_saying_how_many_fit_and_crowded_cores_are_named():
    from benchlib.measure.ranks import crowded_cores, refuse_ranks_beyond_memory

    refuse_ranks_beyond_memory(8, 300 * 2**20, available_bytes=8 * 300 * 2**20)  # exactly fits: no refusal
    with pytest.raises(ValueError, match=r"ranks=64 needs at least 20\.13 GB .* more than the 4\.000 GB free here; at "
                                         r"most 12 such processes fit"):
        refuse_ranks_beyond_memory(64, 300 * 2**20, available_bytes=4_000_000_000)
    assert crowded_cores(4, cores=2) is None
    assert "ranks=64 share 2 core(s): about 32 ranks a core" in crowded_cores(64, cores=2)


def test_ranks_far_beyond_the_cores_are_refused_before_any_rank_starts_and_a_prediction_is_not():
    from types import SimpleNamespace

    from benchlib.measure.ranks import refuse_crowded_cores
    from benchlib.usermodel.parameters import technique_rules

    refuse_crowded_cores(16, cores=2)  # 8 a core: run, said to be crowded
    with pytest.raises(ValueError, match=r"ranks=64 on 2 core\(s\) is 32 ranks a core: .* at most 16 ranks here .*"
                                         r"`benchlib fit FILE --device cuda --ranks 64 --parallel fsdp \.\.\.`"):
        refuse_crowded_cores(64, cores=2)  # before: admitted by memory (64 x 326 MB), then over 5 minutes at load 40
    cores = __import__("os").cpu_count()
    read = SimpleNamespace(techniques={}, resident_bytes=2**20, batch_parameters=None)  # what a reading child reports
    with pytest.raises(ValueError, match="ranks a core"):
        technique_rules(read, {"ranks": 8 * cores + 1, "parallel": "ddp"})
    technique_rules(SimpleNamespace(techniques={}), {"ranks": 8 * cores + 1, "parallel": "ddp"})  # predicted: no rank starts


def _rank(peak: int, baseline: int, checks: dict) -> IsolatedResult:
    measurement = Measurement(name="x", device="cpu", times_s=(0.1,), gc_count=0, gc_seconds=0.0,
                              peak_bytes=peak, baseline_bytes=baseline)
    return IsolatedResult("x", measurement, checks, {"pid": 1})


def test_the_worst_rank_is_the_one_holding_most_and_rank_0_judges_the_gradient():
    result = RankedResult((_rank(100, 500, {"grad_max_rel_err": 0.0, "role_saved_bytes": 7.0}),
                           _rank(150, 400, {"role_saved_bytes": 9.0}),
                           _rank(90, 520, {"role_saved_bytes": 8.0})))
    assert result.worst == 2 and result.environment["worst_rank"] == 2
    assert result.checks == {"role_saved_bytes": 8.0, "grad_max_rel_err": 0.0}
    rows = {(row["metric"], row["params"]["rank"]): row["value"] for row in result.breakdown}
    assert rows[("rank_peak_bytes", 1)] == 150 and rows[("rank_baseline_bytes", 0)] == 500
    assert rows[("rank_role_saved_bytes", 2)] == 8.0


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes of work beside the suite's other workers
def test_fit_on_ranks_answers_per_rank_confirmed_on_real_ranks(tmp_path, capsys):
    from benchlib.fit import QUICK, fit

    batched = (MODEL.replace('"depth": 4}', '"depth": 4, "batch_size": 64}').replace("(width, depth)", "(width, depth, batch_size)")
               .replace("torch.randn(8, 6), torch.randint(0, 2, (8,))",
                        "torch.randn(batch_size, 6), torch.randint(0, 2, (batch_size,))"))
    (tmp_path / "model.py").write_text(textwrap.dedent(batched))
    # 800 MB: two ranks start at about 405 MB each, so the answer is a batch of about 10^4 (at 3 GB, steps of 10 s)
    result = fit(tmp_path / "model.py", memory="800 MB", scale="batch_size", params={"ranks": 2, "parallel": "fsdp",
                                                                                    "width": 256},
                 progress=lambda line: None, search=QUICK.verifying(False))
    (engine,) = result.engines
    assert engine.engine == "fsdp" and result.world_size == 2 and engine.points
    assert "its worst rank's resident high-water mark" in result.total
    assert all(json.loads(record["params"])["world_size"] == 2 for record in result.records() if "params" in record)


def test_one_simulated_rank_holds_half_the_state_and_its_trace_replays_what_real_tensors_allocate(tmp_path):
    from benchlib.fit.predicted import predict_reserved
    from benchlib.usermodel.loader import read_model_file

    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    model_file, values = read_model_file(tmp_path / "model.py"), {"width": 512, "depth": 4}
    alone = predict_reserved(model_file, "torch", values, workspaces=())
    fake = predict_reserved(model_file, "fsdp", values, workspaces=(), world_size=2)
    real = predict_reserved(model_file, "fsdp", values, workspaces=(), world_size=2, fake=False)
    assert (fake.reserved, fake.allocated, fake.segments) == (real.reserved, real.allocated, real.segments)
    state = 4 * sum(p.numel() * 4 for p in model_file.build(values)[0].parameters())  # parameters, gradients, Adam's two
    # a rank holds half the state at rest, but gathers blocks whole and reduces their gradients as it steps (on real
    # gloo ranks an encoder's rank peaked 7% under one process, where its state alone halved)
    assert alone.allocated - fake.allocated > 0.15 * state
    quarter = predict_reserved(model_file, "fsdp", values, workspaces=(), world_size=4)
    assert quarter.allocated < fake.allocated
    with pytest.raises(ValueError, match="DDP's reducer"):
        predict_reserved(model_file, "ddp", values, world_size=2)


def test_fsdp_joined_with_autocast_gathers_parameters_in_its_dtype_and_reduces_in_float32(tmp_path):
    import torch

    from benchlib.engines.techniques.parallel import simulated_rank
    from benchlib.usermodel.case import combination_of
    from benchlib.usermodel.loader import read_model_file

    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    model_file, values = read_model_file(tmp_path / "model.py"), {"width": 32, "depth": 4}
    with simulated_rank(2):
        policies = {engine: combination_of(model_file, engine).place(lambda: model_file.seeded_model(values),
                                                                      torch.device("cpu"))._get_fsdp_state()._mp_policy
                    for engine in ("fsdp", "fsdp+torch-autocast")}
    assert (policies["fsdp"].param_dtype, policies["fsdp"].reduce_dtype) == (None, None)
    assert (policies["fsdp+torch-autocast"].param_dtype, policies["fsdp+torch-autocast"].reduce_dtype) == \
        (torch.bfloat16, torch.float32)


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="measures the ranks where there are GPUs")
def test_fit_on_ranks_on_cuda_without_a_gpu_predicts_rank_0_from_one_process(tmp_path, capsys):
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    assert main(["fit", str(tmp_path / "model.py"), "--memory", "1GB", "--scale", "width", "--ranks", "2",
                 "--parallel", "ddp,fsdp", "--device", "cuda", "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "per rank (" in said and "across 2 ranks), with fsdp" in said
    assert "rank 0 of 2 simulated in one process" in said and "ddp   not predicted: DDP's reducer" in said
    records = load_records(next((tmp_path / "out").iterdir()))
    assert all(json.loads(record["params"])["world_size"] == 2 for record in records.to_dict("records")
               if record["metric"] == "max_fitting")


@pytest.mark.slow  # a child reads the file
def test_a_global_batch_naming_a_parameter_that_leaves_the_batch_as_it_is_is_refused_before_any_work(tmp_path, capsys):
    batched = (MODEL.replace('"depth": 4}', '"depth": 4, "batch_size": 8}').replace("(width, depth)", "(width, depth, batch_size)")
               .replace("torch.randn(8, 6), torch.randint(0, 2, (8,))",
                        "torch.randn(batch_size, 6), torch.randint(0, 2, (batch_size,))"))
    (tmp_path / "model.py").write_text(textwrap.dedent(batched))
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "model.py"), "--quick", "--ranks", "2", "--parallel", "ddp", "--global-batch",
                 "width=64", "--out", str(out)]) == 2  # before: each rank's model built half as wide, in silence
    said = capsys.readouterr().err
    assert "--global-batch width=...: width does not change the batch" in said and not out.exists()
    assert "the parameters that change the batch: batch_size" in said
    from benchlib.usermodel.parameters import technique_rules
    from benchlib.usermodel.reading import read_in_child

    ((facts,),) = read_in_child([[str(tmp_path / "model.py")]])
    assert facts.batch_parameters == ("batch_size",)
    technique_rules(facts, {"ranks": 2, "parallel": "ddp", "global_batch": "batch_size"})  # a batch: accepted


def test_what_the_flags_alone_settle_is_refused_before_any_file_is_read():
    """A strategy on one process, an unknown one, or ranks with neither a strategy nor named engines: refused by the
    flags' parsing, which starts no process (it took a reading child and a kernel: 6.5 s a refusal in the suite)."""
    from argparse import Namespace

    from benchlib.errors import Refused
    from benchlib.runner.arguments import RunnerError, ranks_params

    with pytest.raises(RunnerError, match="ranks=2: say how the step is spread over them: --parallel ddp or fsdp"):
        ranks_params(Namespace(ranks=2, parallel=None), {})
    with pytest.raises(RunnerError, match=r"fsdp runs on several ranks: give --ranks N \(N >= 2\)"):
        ranks_params(Namespace(ranks=None, parallel="fsdp"), {})
    with pytest.raises(RunnerError, match="ddp runs on several ranks"):
        ranks_params(Namespace(ranks=None, parallel=None), {"parallel": "ddp"})
    with pytest.raises(Refused, match="'zero3' is no parallel strategy; valid: ddp, fsdp"):
        ranks_params(Namespace(ranks=2, parallel="zero3"), {})
    # named engines may place the step themselves (a file's own technique among them): their file's reading tells
    assert ranks_params(Namespace(ranks=2, parallel=None), {"engines": "fsdp+torch-checkpoint"})["ranks"] == "2"
    assert ranks_params(Namespace(ranks=2, parallel=None, engines="fsdp"), {}) == {"ranks": "2"}  # fit's --engines


def test_a_global_batch_is_split_evenly_over_the_ranks_or_refused_saying_what_would():
    from argparse import Namespace

    from benchlib.runner.arguments import ranks_params
    from benchlib.runner.arguments import RunnerError

    asked = Namespace(ranks=4, parallel="fsdp", global_batch="batch_size=64")
    assert ranks_params(asked, {"width": "8"}) == {"width": "8", "ranks": "4", "parallel": "fsdp", "batch_size": "16",
                                                  "global_batch": "batch_size"}
    for ranks, global_batch, given, words in [
        (4, "batch_size=66", {}, "does not split evenly over 4 ranks; a multiple of 4 does (e.g. batch_size=64)"),
        (None, "batch_size=64", {}, "give --ranks N"),
        (2, "batch_size=64", {"batch_size": "8"}, "both set batch_size"),
        (2, "batch_size=lots", {}, "must be a whole number"),
        (2, "batch_size=0", {}, "must be at least 1 sample per rank (batch_size=2 or more over 2 ranks)"),
        (2, "batch_size=64", {"ranks": "3"}, "--ranks 2 and -p ranks=3 both set ranks; give one"),
    ]:
        with pytest.raises(RunnerError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ranks_params(Namespace(ranks=ranks, parallel="fsdp", global_batch=global_batch), given)


HANGS = """
import time

def loss(model, x, y):
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() == 1:
        time.sleep(3600)
    return nn.functional.cross_entropy(model(x), y)
"""


@pytest.mark.slow
@pytest.mark.serial  # which rank's clock runs out first is a race: rank 0's starts before its collective does
def test_a_rank_that_hangs_is_named_and_not_the_rank_waiting_for_it(tmp_path):
    from benchlib.measure import CaseFailed, IsolationOptions, rank_devices, resolve_device, run_ranks
    from benchlib.usermodel.measuring import RANKED_TARGET

    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL + HANGS))
    params = {"path": str(tmp_path / "model.py"), "engine": "ddp", "values": {"width": 32, "depth": 4}}
    with pytest.raises(CaseFailed) as failed:
        run_ranks(RANKED_TARGET, params, name="hangs", world_size=2, devices=rank_devices(resolve_device("cpu"), 2),
                  options=IsolationOptions(timeout_s=45))  # 36 s for rank 0's collective: 9 s for both to start (alone)
    assert "rank 1 of 2 failed first: timed out after 45 s" in failed.value.reason
    assert "rank 0: its collective lost rank 1" in failed.value.reason
