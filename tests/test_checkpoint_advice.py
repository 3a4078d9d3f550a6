"""Checkpoint advice: `torch-checkpoint[...]` checkpoints exactly the blocks it names and computes eager's gradient;
`fit --at` picks the fewest blocks from the activations each saved, measures that plan, and adds a block where the
measured plan is still over."""

import textwrap

import pytest
import torch

from benchlib.engine_names import split_names
from benchlib.engines.gradients import max_relative_error
from benchlib.engines.techniques import CombinationError, Step, StepFacts, TechniqueFault, combine, technique_registry
from benchlib.engines.techniques.base import Misnamed
from benchlib.engines.techniques.modules import checkpoint_blocks, module_spec, parse_module_spec
from benchlib.fit import measured
from benchlib.fit.measured import StepOutcome
from benchlib.fit.advice import fewest_blocks, saved_by_block
from benchlib.fit.at import fit_at
from benchlib.records.metrics import MODULE_METRIC
from benchlib.usermodel.case import memory_by_role

MB = 10 ** 6
STACK = """
import torch
from torch import nn

NAME = "stack"
PARAMETERS = {"n": 8}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))

def model(n):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Sequential(*[Block() for _ in range(6)]), nn.Linear(16, 1))

def batch(n):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()
"""


def test_names_with_modules_split_parse_and_print_back():
    assert split_names("torch, torch-checkpoint[blocks.0-2,blocks.7],torch.func") == [
        "torch", "torch-checkpoint[blocks.0-2,blocks.7]", "torch.func"]
    paths = ["1.0", "1.1", "1.2", "1.5", "head"]
    assert module_spec(paths) == "1.0-2,1.5,head" and parse_module_spec(module_spec(paths)) == tuple(paths)
    registry = technique_registry()
    joined = combine("torch-autocast+torch-checkpoint[1.0-2]", registry)
    assert joined.name == "torch-checkpoint[1.0-2]+torch-autocast" and joined.parts[0].modules == ("1.0", "1.1", "1.2")
    for bad, words in (("torch[1.0]", "takes no modules"), ("torch-checkpoint[1.3-1]", "lower index"),
                       ("torch-checkpoint[]", "empty module path"),
                       ("torch-checkpoint[1.0,1.0.lin]", "names 1.0.lin inside 1.0: a block is recomputed whole"),
                       ("torch-checkpoint[1.0-2,1.1.lin]", "names 1.1.lin inside 1.1")):
        with pytest.raises(CombinationError, match=words):
            combine(bad, registry)


def _module(tmp_path):
    from benchlib.usermodel.loader import read_model_file

    path = tmp_path / "stack.py"
    path.write_text(textwrap.dedent(STACK))
    return read_model_file(path)


def test_a_checkpoint_on_named_blocks_keeps_eagers_gradient_and_saves_only_theirs(tmp_path):
    model_file = _module(tmp_path)
    assert checkpoint_blocks(model_file.build({"n": 8})[0]) == [f"1.{index}" for index in range(6)]
    saved, gradients = {}, {}
    for engine in ("torch", "torch-checkpoint[1.0-1]", "torch-checkpoint"):
        model, batch = model_file.build({"n": 64})
        step = Step(engine, model, batch, model_file.loss, None)
        captured = {}
        with step.observe(lambda name, g: captured.__setitem__(name, g.clone())):
            step()
        gradients[engine] = [captured[name] for name, _ in step.named]
        roles, rows = memory_by_role(step, 2)
        saved[engine] = {row["params"]["module"]: row["value"] for row in rows if row["params"]["role"] == "saved"}
    assert max_relative_error(gradients["torch-checkpoint[1.0-1]"], gradients["torch"]) < 1e-6
    named, eager, every = saved["torch-checkpoint[1.0-1]"], saved["torch"], saved["torch-checkpoint"]
    assert named["1.0"] < eager["1.0"] and named["1.1"] < eager["1.1"]  # checkpointed: only the block's input
    assert named["1.2"] == eager["1.2"] and named["1.5"] == eager["1.5"]  # the others as eager keeps them
    assert sum(every.values()) < sum(named.values()) < sum(eager.values())
    model = model_file.build({"n": 8})[0]
    with pytest.raises(TechniqueFault, match=r"^torch-checkpoint\[1.9\]: the model \(Sequential\) has no module 1.9; "
                                             r"its blocks: 1.0-5$"):  # a misspelt path fails, never "not applicable"
        combine("torch-checkpoint[1.9]", technique_registry()).not_applicable(model, StepFacts(False, False, "cpu", 1))


def _rows(saved: dict) -> list[dict]:
    return [{"metric": MODULE_METRIC, "value": value, "params": {"module": module, "role": "saved"}}
            for module, value in saved.items()]


def test_the_fewest_blocks_are_the_largest_savers_with_one_recomputed_at_a_time():
    saved = saved_by_block(_rows({"1.0.a": 30.0, "1.0": 10.0, "1.1.b": 20.0, "1.2": 5.0, "0": 99.0}),
                           ["1.0", "1.1", "1.2"])
    assert saved == {"1.0": 40.0, "1.1": 20.0, "1.2": 5.0}  # a block's inner modules are its own
    assert fewest_blocks(200.0, saved, 180.0) == (["1.0", "1.1"], 200.0 - 60.0 + 40.0)
    assert fewest_blocks(200.0, saved, 100.0) == (["1.0", "1.1", "1.2"], 200.0 - 65.0 + 40.0)  # never enough
    assert fewest_blocks(200.0, {"1.0": 0.0}, 100.0) == ([], 200.0)


def test_fit_at_advises_the_blocks_measures_them_and_adds_one_where_the_plan_is_still_over(fit_children_here, tmp_path, monkeypatch):
    per_block = 10 * MB  # each of the six blocks saves this much; a checkpointed block keeps a fifth of it
    base = 200 * MB
    measured_engines = []

    def measure(_file, engine, values, _device, by_module=None, **_options):
        measured_engines.append(engine)
        blocks = parse_module_spec(engine[len("torch-checkpoint["):-1]) if engine.endswith("]") else ()
        if by_module is not None:
            by_module += _rows({f"1.{index}.a": per_block * (1 + index / 10) for index in range(6)})
        total = base + sum(per_block * (1 + index / 10) * (0.2 if f"1.{index}" in blocks else 1) for index in range(6))
        # the recomputation costs more than the prediction says
        return StepOutcome(int(total + 15 * MB * bool(blocks)), 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    monkeypatch.setattr("benchlib.measure.isolation.available_memory", lambda device: 10 ** 12)
    path = tmp_path / "stack.py"
    path.write_text(textwrap.dedent(STACK))
    result = fit_at(path, memory=f"{int(base + 50 * MB)}", at="n=8", engines=["torch"], progress=lambda line: None)
    advice = result.advice
    # eager: 200 + 75 = 275 MB. Largest savers first (1.5, 1.4, ...): three blocks are predicted at 275 - 42 + 15 =
    # 248 MB, under 250, but measured at 256.4 (the recomputation costs more); a fourth joins and fits (246.8)
    assert measured_engines == ["torch", "torch-checkpoint[1.3-5]", "torch-checkpoint[1.2-5]"]
    assert advice.fits and advice.engine == "torch-checkpoint[1.2-5]" and advice.blocks == ("1.2", "1.3", "1.4", "1.5")
    assert advice.predicted == pytest.approx((275 - 54 + 15) * MB)  # the prediction of the plan advised
    assert [engine.engine for engine in result.fitting] == ["torch-checkpoint[1.2-5]"]
    line = result.lines()[-1]
    assert "torch does not fit: checkpointing 4 of its 6 blocks, torch-checkpoint[1.2-5]" in line and "fits" in line
    records = result.records()
    assert {row["variant"] for row in records if row["metric"] == "fit_total_bytes"} == {
        "torch", "torch-checkpoint[1.2-5]"}


def test_a_plan_predicted_over_is_still_measured_and_said_over_only_as_measured(fit_children_here, tmp_path, monkeypatch):
    def measure(_file, engine, values, _device, by_module=None, **_options):
        if by_module is not None:
            by_module += _rows({f"1.{index}": 10 * MB for index in range(6)})
        return StepOutcome(310 * MB if engine == "torch" else 240 * MB, 1e-3)  # recomputation far under the prediction

    monkeypatch.setattr(measured, "measure_step", measure)
    monkeypatch.setattr("benchlib.measure.isolation.available_memory", lambda device: 10 ** 12)
    path = tmp_path / "stack.py"
    path.write_text(textwrap.dedent(STACK))
    advice = fit_at(path, memory=f"{250 * MB}", at="n=8", engines=["torch"], progress=lambda line: None).advice
    assert advice.predicted == pytest.approx(310 * MB - 60 * MB + 10 * MB) and advice.predicted > 250 * MB
    assert advice.engine == "torch-checkpoint[1.0-5]" and advice.fits  # measured, not refused on the prediction


def test_a_range_of_blocks_the_model_lacks_is_named_as_a_range():
    from benchlib.engines.techniques import StepFacts
    from benchlib.engines.techniques.builtin import Checkpoint

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    technique = Checkpoint().acting_on(tuple(f"{index}" for index in range(100)))
    with pytest.raises(Misnamed, match=r"^the model \(Sequential\) has no module 4-99; its blocks: 0-3$"):
        technique.not_applicable(model, StepFacts(False, False, "cpu", 1))
