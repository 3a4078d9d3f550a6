"""Memory by module path: what a step's roles hold, module by module, agrees with an independent count (torch's
own ModuleTracker under saved-tensor hooks), sums to the role totals, and is read back where people look:
the summary line, compare (a block made to save more is flagged at that block), the gate and the report."""

import json

import pandas as pd
import pytest
import torch
from torch import nn

from benchlib.analysis.compare import compact_table, compare_records, headline
from benchlib.analysis.module_paths import NO_MODULE, ROOT, cut_path, path_levels
from benchlib.analysis.modules import module_table, module_totals
from benchlib.engines.roles import GRADIENT_METRIC, OPTIMIZER_METRIC, PARAMETER_METRIC, SAVED_METRIC
from benchlib.engines.techniques import Step
from benchlib.records import make_record
from benchlib.records.metrics import GRADIENT_ROLE, MODULE_METRIC, OPTIMIZER_ROLE, PARAMETER_ROLE, SAVED_ROLE
from benchlib.usermodel.case import memory_by_role
from benchlib.usermodel.gate import Limits, StepCost, check_step

ROLE_METRICS = {PARAMETER_ROLE: PARAMETER_METRIC, OPTIMIZER_ROLE: OPTIMIZER_METRIC, GRADIENT_ROLE: GRADIENT_METRIC,
                SAVED_ROLE: SAVED_METRIC}


@pytest.mark.parametrize("path, depth, cut, levels", [
    ("encoder.layers.3.mlp.fc1", 2, "encoder.layers.3", ["encoder", "encoder.layers.3", "encoder.layers.3.mlp",
                                                          "encoder.layers.3.mlp.fc1"]),
    ("blocks.0.attn", 1, "blocks.0", ["blocks.0", "blocks.0.attn"]),
    ("3.0.fn.0", 2, "3.0", ["3", "3.0", "3.0.fn.0"]),  # a Sequential in a Sequential: an index after an index
    ("head", 3, "head", ["head"]),
    ("", 2, ROOT, [ROOT]),
])
def test_paths_are_cut_by_levels_where_an_index_joins_its_container(path, depth, cut, levels):
    assert cut_path(path, depth) == cut and path_levels(path) == levels


class Block(nn.Module):
    def __init__(self, width, wasteful=False):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.wasteful = wasteful

    def forward(self, x):
        hidden = torch.tanh(self.up(x))
        if self.wasteful:  # three more saved tensors of the hidden's size: four times what it saves
            hidden = hidden.exp().log().sin().asin()
        return x + self.down(hidden)


class Net(nn.Module):
    def __init__(self, width=16, depth=3, wasteful=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, index == wasteful) for index in range(depth))
        self.head = nn.Linear(width, 4)
        self.tied = nn.Linear(width, 4)
        self.tied.weight = self.head.weight  # one storage, counted once, for its first owner

    def forward(self, x):
        for block in self.blocks:
            x = block(self.embed(x) if block is self.blocks[0] else x)
        return self.head(x) + self.tied(x)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y) * 2.0  # saved outside every module


def _step(wasteful=None) -> Step:
    model = Net(wasteful=wasteful)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    step = Step("torch", model, batch, _loss, lambda parameters: torch.optim.Adam(parameters, lr=1e-3))
    step()  # Adam's state exists, as after a run's warm-up step
    return step


def _by_module(rows) -> dict[tuple[str, str], float]:
    assert all(row["metric"] == MODULE_METRIC for row in rows)
    return {(row["params"]["module"], row["params"]["role"]): row["value"] for row in rows}


def test_each_roles_modules_sum_to_its_total_and_own_what_they_should():
    roles, rows = memory_by_role(_step(), 1)
    by_module = _by_module(rows)
    for role, metric in ROLE_METRICS.items():
        assert sum(v for (_, r), v in by_module.items() if r == role) == roles[metric]
    model = Net()
    block = sum(p.nbytes for p in model.blocks[1].parameters())
    assert by_module["blocks.1", PARAMETER_ROLE] == block == by_module["blocks.1", GRADIENT_ROLE]
    assert by_module["blocks.1", OPTIMIZER_ROLE] >= 2 * block  # Adam's two moments (and its step counter)
    assert ("tied", PARAMETER_ROLE) in by_module and by_module["tied", PARAMETER_ROLE] == model.tied.bias.nbytes
    assert by_module[NO_MODULE, SAVED_ROLE] > 0  # the loss's own saved tensors
    assert {module for module, _ in by_module} == {"embed", "blocks.0", "blocks.1", "blocks.2", "head", "tied",
                                                   NO_MODULE}
    deeper = _by_module(memory_by_role(_step(), 2)[1])  # blocks.1 is one level: its index joins it
    assert ("blocks.1.up", PARAMETER_ROLE) in deeper and ("blocks.1", PARAMETER_ROLE) not in deeper
    assert ("blocks.1", SAVED_ROLE) in deeper  # what Block.forward saves itself, outside up and down


def _independent_saved(step: Step) -> dict[str, int]:
    """Saved bytes by innermost module at the most saved at once, counted by torch's ModuleTracker under
    saved-tensor hooks: one forward and backward, as the step does."""
    from torch.utils.module_tracker import ModuleTracker

    inputs = {t.untyped_storage().data_ptr() for t in (*step.batch, *step.model.parameters())}
    live: dict[int, tuple[str, int]] = {}
    now: dict[str, int] = {}
    best: dict[str, int] = {}
    root = type(step.model).__name__

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in inputs and key not in live:
            names = [name for name in tracker.parents if name != "Global"]
            inner = max(names, key=lambda name: name.count("."), default=None)
            module = cut_path(inner.removeprefix(root).lstrip("."), 2) if inner else NO_MODULE
            live[key] = module, tensor.untyped_storage().nbytes()
            now[module] = now.get(module, 0) + live[key][1]
            if sum(now.values()) > sum(best.values()):
                best.clear()
                best.update(now)
        return tensor

    with ModuleTracker() as tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _loss(step.model, *step.batch).backward()
    return best


@pytest.mark.parametrize("wasteful", [None, 1])
def test_the_module_holding_most_saved_agrees_with_torchs_module_tracker(wasteful):
    step = _step(wasteful)
    ours = {module: value for (module, role), value in _by_module(memory_by_role(step, 2)[1]).items() if role == SAVED_ROLE}
    theirs = _independent_saved(step)
    top = max(ours, key=ours.get)
    assert top == max(theirs, key=theirs.get) == ("blocks.1" if wasteful == 1 else top)
    assert abs(ours[top] / sum(ours.values()) - theirs[top] / sum(theirs.values())) < 0.02


def _records(step: Step, engine="torch", trials=2) -> list[dict]:
    labels = dict(benchmark="net", case="step", engine=engine, device="cpu", dtype="float32")
    return [make_record(**labels, metric=row["metric"], value=row["value"], params={**row["params"], "trial": trial})
            for trial in range(trials) for row in memory_by_role(step, 2)[1]]


def test_compare_flags_the_block_a_wasteful_twin_made_save_more_and_names_it():
    before, after = pd.DataFrame(_records(_step())), pd.DataFrame(_records(_step(wasteful=1)))
    comparison = compare_records(before, after)
    modules = comparison[comparison["metric"] == MODULE_METRIC]
    worse = modules[modules["label"] == "worse"]
    assert [json.loads(config)["module"] for config in worse["config"]] == ["blocks.1"]
    assert json.loads(worse["config"].iloc[0])["role"] == SAVED_ROLE
    assert worse["ratio"].iloc[0] > 2.5
    assert any("net/step/torch/module_bytes blocks.1 saved" in line for line in headline(comparison))
    assert any(line.startswith("net/step/torch/module_bytes blocks.1 saved") and "worse" in line
               for line in compact_table(comparison, width=200))


def test_the_summary_table_and_report_name_the_largest_module():
    from benchlib.report.tables.modules import modules_section

    records = pd.DataFrame(_records(_step(wasteful=2)) + _records(_step(), engine="torch-checkpoint"))
    totals = module_totals(module_table(records))
    torch_rows = totals[totals["engine"] == "torch"]
    assert abs(torch_rows["share"].sum() - 1.0) < 1e-9
    assert torch_rows["total"].is_monotonic_decreasing
    parts = modules_section(records, "net")
    assert "Which module holds the memory" in parts[0]
    figure = parts[2]
    assert [trace.name for trace in figure.data] == ["torch", "torch-checkpoint"]
    assert figure.data[0].values[0] == pytest.approx(torch_rows["total"].sum())  # the root holds every module
    assert modules_section(records[records["metric"] != MODULE_METRIC], "net") == []


def _cost(step: Step, peak: int) -> StepCost:
    modules: dict = {}
    for (module, role), value in _by_module(memory_by_role(step, 2)[1]).items():
        modules.setdefault(module, {})[role] = value
    return StepCost("net", "net.py", "torch", "cpu", {}, peak, 100, 10, None, {}, (), modules)


def test_the_gate_names_the_module_that_grew_and_the_largest_one_over_a_limit():
    baseline, grown = _cost(_step(), 1_000_000), _cost(_step(wasteful=2), 1_500_000)
    problems = check_step(grown, Limits.parse(growth="1.2x"), baseline)
    assert "the module that grew the most: blocks.2 (saved activations +" in problems[0]
    over = check_step(grown, Limits.parse(peak="1 MB"))
    assert "the largest module: blocks.2" in over[0]
    assert StepCost.from_json({**baseline.to_json(), "modules": {}}).modules == {}  # baselines from before


def test_history_keeps_each_module_and_role_a_series_and_names_the_one_that_stepped():
    from benchlib.analysis.history import build_series, find_steps, series_name

    rows = []
    for index, step in enumerate([_step()] * 3 + [_step(wasteful=1)] * 3):
        for row in _records(step):
            rows.append({**row, "run_id": f"run{index}", "started_at": f"2026-11-{index + 1:02d}T10:00:00+00:00",
                         "commit": f"c{index:06d}"})
    series = build_series(pd.DataFrame(rows), metrics=[MODULE_METRIC])
    steps = find_steps(series, threshold=0.05)
    assert [series_name(row) for row in steps.itertuples()] == ["net/step/torch/module_bytes blocks.1 saved"]
    assert steps.iloc[0]["to_run"] == "run3"
