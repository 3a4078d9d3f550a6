"""Step techniques as parts that compose: one interface, joined with `+`, refused before any work where
they cannot join, checked like any engine; a model file's own technique and an installed package's."""

import ast
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchlib import engine_names
from benchlib.engine_names import (COMBINED, DEFAULT_COMBINATIONS, FUSED_OPTIMIZER, TORCH, TORCH_AUTOCAST,
                                   TORCH_CHECKPOINT, TORCH_MICROBATCH, TORCH_SAC)
from benchlib.engines.gradients import gradient_tolerance, max_relative_error
from benchlib.engines.techniques import (BUILTIN, PARALLEL, Aspect, CombinationError, Step, StepFacts, Technique,
                                         TechniqueOptions, added_combinations, combine, technique_registry)

PROJECT = Path(__file__).resolve().parents[1]
EXAMPLE = PROJECT / "docs" / "examples" / "half_saved.py"
THREE_WAY = COMBINED.join((TORCH_CHECKPOINT, TORCH_AUTOCAST, TORCH_MICROBATCH))


class Block(nn.Module):
    """A residual block with GroupNorm: what a U-Net or a ResNet repeats."""

    def __init__(self, width):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.GroupNorm(4, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.body(x)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Sequential(*(Block(32) for _ in range(4))), nn.Linear(32, 3))


def data(n=16):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def mean_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def gradient(engine, options=TechniqueOptions(), optimizer=None):
    step = Step(engine, model(), data(), mean_loss, optimizer, options=options)
    captured = {}
    with step.observe(lambda name, g: captured.__setitem__(name, g.detach().clone())):
        step()
    return [captured[name] for name, _ in step.named], step


def test_techniques_join_in_the_registrys_order_and_the_default_combinations_are_valid():
    registry = technique_registry()
    assert combine("torch-microbatch+torch-autocast+torch-checkpoint", registry).name == THREE_WAY
    for name in DEFAULT_COMBINATIONS:
        assert combine(name, registry).name == name  # written as the records will carry them
    assert set(added_combinations("default", registry)) == set(DEFAULT_COMBINATIONS)
    assert added_combinations("default", registry, named=[THREE_WAY]) == \
        [name for name in DEFAULT_COMBINATIONS if name != THREE_WAY]
    assert added_combinations("none", registry) == []
    every = added_combinations("all", registry)
    assert set(DEFAULT_COMBINATIONS) <= set(every) and all(COMBINED in name for name in every)


@pytest.mark.parametrize("name, words", [
    (f"{FUSED_OPTIMIZER}+{TORCH_MICROBATCH}", "steps each parameter's optimizer from its gradient's hook, while "
                                              "torch-microbatch accumulates a gradient over several parts"),
    (f"{TORCH_CHECKPOINT}+{TORCH_SAC}", "torch-checkpoint and torch-sac both change what backward saves"),
    (f"{TORCH}+{TORCH_SAC}", "torch is the eager step every technique changes"),
    (f"{TORCH_SAC}+{TORCH_SAC}", "names a technique twice"),
    ("torch-autocast+nope", "'nope' is no technique; valid: torch, ddp, fsdp, torch.func"),
    ("torch.func+torch-checkpoint", "torch.func computes the gradient with grad()"),
    ("ddp+torch.func", "whose hooks ddp reduces the ranks' gradients in: each rank would step on its own"),
    ("fsdp+torch.func", "whose hooks fsdp reduces the ranks' gradients in"),
    ("torch.compile+torch-sac", "torch-sac and torch.compile both change what backward saves"),
])
def test_a_combination_that_cannot_exist_is_refused_naming_the_pair_and_why(name, words):
    with pytest.raises(CombinationError, match=None) as refused:
        combine(name, technique_registry())
    assert words in str(refused.value)


@pytest.mark.parametrize("engine", [THREE_WAY, f"{TORCH_SAC}+{TORCH_AUTOCAST}", f"{TORCH_CHECKPOINT}+{TORCH_MICROBATCH}"])
def test_a_combination_computes_eager_torchs_gradient_within_its_loosest_parts_tolerance(engine):
    eager, _ = gradient(TORCH)
    combined, step = gradient(engine)
    dtype = step.combination.computes_in or "float32"
    assert dtype == ("bfloat16" if TORCH_AUTOCAST in engine else "float32")
    assert max_relative_error(combined, eager) <= gradient_tolerance(dtype)


def test_microbatches_is_a_setting_of_the_technique_alone_or_joined():
    for engine in (TORCH_MICROBATCH, f"{TORCH_AUTOCAST}+{TORCH_MICROBATCH}"):
        _, step = gradient(engine, TechniqueOptions(microbatches=2))
        assert [len(batch[0]) for batch, _ in step.parts] == [8, 8]
        assert step.combination.params(step.model)["microbatches"] == 2


def test_a_combination_says_why_its_first_part_that_cannot_run_does_not():
    registry = technique_registry()
    facts = StepFacts(has_optimizer=False, has_step=False, device_kind="cpu")
    assert combine(f"{FUSED_OPTIMIZER}+{TORCH_AUTOCAST}", registry).not_applicable(model(), facts).startswith(
        "fused-optimizer: the file declares no optimizer(parameters)")
    assert "this model's parameters are float64" in combine(THREE_WAY, registry).not_applicable(
        model().double(), facts)
    assert combine(THREE_WAY, registry).not_applicable(model(), facts) is None


def test_a_fused_optimizer_joined_with_autocast_steps_once_per_parameter():
    _, step = gradient(f"{FUSED_OPTIMIZER}+{TORCH_AUTOCAST}",
                       optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.1))
    assert len(step.optimizers) == len(step.named) and step.owns_optimizer


# the roles an engine holds, not engines: the baseline every gradient and ratio is checked against (eager torch in
# a model file's run, the hand-written gradient in an array workload's) and the seed's own code beside it
ROLES = ("REFERENCE", "REFERENCE_ENGINE", "SEED_ENGINE")


def test_no_engine_name_is_compared_outside_benchlib_engines():
    """A technique's or an engine's behaviour lives in its own class (benchlib/engines/); elsewhere nothing
    branches on an engine's name: not by its constant, not by a module's alias of one (`COMPILE_ENGINE =
    TORCH_COMPILE`, or `import TORCH as EAGER`), not by its text where engines are held (an `engine` or a record's `variant`). The reference is
    a role, which any engine could hold."""
    constants = {name for name in engine_names.__all__ if name not in ("COMBINED", "REFERENCE")}
    values = {value for name in constants if isinstance(value := getattr(engine_names, name), str)}
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sorted((PROJECT / "benchlib").rglob("*.py"))}
    for tree in trees.values():  # a name imported under another (`from benchlib.engine_names import TORCH as EAGER`)
        constants |= {alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      and node.module == "benchlib.engine_names" for alias in node.names
                      if alias.asname and alias.name in constants}
    for _ in range(3):  # aliases of aliases
        for path, tree in trees.items():
            for node in tree.body if path.name != "engine_names.py" else ():  # a module's own names for engine names
                if isinstance(node, ast.Assign) and _names_engine(node.value, constants, values):
                    constants |= {target.id for target in ast.walk(node.targets[0]) if isinstance(target, ast.Name)
                                  and target.id.isupper() and target.id not in ROLES}

    found = []
    for path, tree in trees.items():
        relative = path.relative_to(PROJECT / "benchlib")
        if relative.parts[0] == "engines" or relative.name == "engine_names.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                            for op in node.ops):
                continue
            seen = set(_words(node))
            holds_engines = any("engine" in word.lower() or word.strip("'") == "variant" for word in seen)
            if seen & constants or (holds_engines and seen & {repr(value) for value in values}):
                found.append(f"{relative}:{node.lineno}")
    assert found == []


def _words(node):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            yield sub.id
        elif isinstance(sub, ast.Attribute):
            yield sub.attr
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield repr(sub.value)


def _names_engine(value, constants: set, values: set) -> bool:
    """An assigned value that is an engine's name: its constant, its text, or a tuple of them."""
    parts = value.elts if isinstance(value, ast.Tuple) else [value]
    return bool(parts) and all(isinstance(part, ast.Name) and part.id in constants or isinstance(part, ast.Constant)
                               and part.value in values for part in parts)


class Doubled(Technique):
    """A throwaway technique: the forward under a context that does nothing, to count what joining costs."""

    description = "nothing, twice"
    changes = frozenset({Aspect.FORWARD})


def test_a_model_files_technique_joins_the_registry_and_is_checked_like_the_built_ins(tmp_path):
    registry = technique_registry({"doubled": Doubled})
    assert list(registry)[-1] == "doubled" and registry["doubled"].name == "doubled"
    combination = combine(f"{TORCH_AUTOCAST}+doubled", registry)
    assert combination.name == f"{TORCH_AUTOCAST}+doubled"
    with pytest.raises(CombinationError, match="benchlib's own technique"):
        technique_registry({TORCH_SAC: Doubled})
    with pytest.raises(CombinationError, match="must be a subclass"):
        technique_registry({"mine": object})
    with pytest.raises(CombinationError, match="without '\\+'"):
        technique_registry({"a+b": Doubled})


def test_an_installed_package_registers_a_technique_under_its_entry_point_group(tmp_path, monkeypatch):
    from benchlib.engines import techniques

    (tmp_path / "extra_technique.py").write_text(
        "from benchlib.engines.techniques import Aspect, Technique\n\n"
        "class Extra(Technique):\n    changes = frozenset({Aspect.FORWARD})\n")
    info = tmp_path / "extra_technique-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-technique\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[benchlib.techniques]\nextra = extra_technique:Extra\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    techniques.installed_techniques.cache_clear()
    try:
        registry = technique_registry()
        assert "extra" in registry and list(registry)[:len(BUILTIN) + len(PARALLEL)] == [TORCH, *PARALLEL, *list(BUILTIN)[1:]]
        assert combine(f"{TORCH_CHECKPOINT}+extra", registry).name == f"{TORCH_CHECKPOINT}+extra"
    finally:
        techniques.installed_techniques.cache_clear()
        sys.modules.pop("extra_technique", None)


def run(*args, cwd):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    return subprocess.run([sys.executable, "-m", "benchlib", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_techniques_that_cannot_join_are_refused_before_any_work(tmp_path):
    done = run("run", str(EXAMPLE), "--quick", "-p", f"engines=torch,{FUSED_OPTIMIZER}+{TORCH_MICROBATCH}",
               "--out", "out", cwd=tmp_path)
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert "fused-optimizer+torch-microbatch' cannot run as one step: fused-optimizer steps each" in done.stderr


@pytest.mark.slow
def test_the_documented_technique_is_measured_checked_and_combined(tmp_path):
    from benchlib.records import load_records

    engines = ["torch", "half-saved", f"half-saved+{TORCH_MICROBATCH}"]
    done = run("run", str(EXAMPLE), "--quick", "--device", "cpu", "-p", f"engines={','.join(engines)}",
               "-p", "microbatches=2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = load_records(next((tmp_path / "out").iterdir()))
    joined = f"{TORCH_MICROBATCH}+half-saved"  # named in the registry's order: benchlib's own first
    assert set(records["variant"]) == {"torch", "half-saved", joined}
    errors = records[records["metric"] == "grad_max_rel_err"].set_index("variant")["value"]
    assert set(errors.index) == {"half-saved", joined} and (errors <= gradient_tolerance("float16")).all()
    dtypes = records.drop_duplicates("variant").set_index("variant")["dtype"]
    assert dtypes["half-saved"] == "float16" and dtypes["torch"] == "float32"
    import json
    combined = records[(records["variant"] == joined) & (records["metric"] == "peak_bytes")]["params"].map(json.loads)
    assert len(combined) and all(params["techniques"] == ["torch-microbatch", "half-saved"]
                                 and params["microbatches"] == 2 for params in combined)


FAULTY = '''import torch
from torch import nn

from benchlib.engines.techniques import Technique


class Faulty(Technique):
    description = "a technique whose own check raises"

    def not_applicable(self, model, facts):
        raise KeyError("no such layer")


class RefusesBadly(Technique):
    description = "a technique whose refusal check raises"

    def refuses(self, other):
        return 1 / 0


TECHNIQUES = {"faulty": Faulty, "refuses-badly": RefusesBadly}
PARAMETERS = {"n": 8}


def model(n):
    return nn.Linear(4, 2)


def batch(n):
    return torch.randn(n, 4), torch.randn(n, 2)


def loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)
'''


def test_a_technique_whose_own_hook_raises_fails_its_steps_alone_and_names_itself(tmp_path):
    from benchlib.measure import resolve_device
    from benchlib.usermodel.loader import read_model_file
    from benchlib.usermodel.measuring import TORCH_FORM

    path = tmp_path / "faulty_model.py"
    path.write_text(FAULTY)
    engines = [TORCH, TORCH_AUTOCAST, "faulty", f"{TORCH_AUTOCAST}+faulty", f"{TORCH_AUTOCAST}+refuses-badly"]
    facts = TORCH_FORM.facts(read_model_file(path), {"n": 8}, resolve_device("cpu"), engines, {})
    assert set(facts.failed) == {"faulty", f"{TORCH_AUTOCAST}+faulty", f"{TORCH_AUTOCAST}+refuses-badly"}
    assert facts.failed["faulty"] == "technique faulty: its not_applicable raised KeyError: 'no such layer'"
    assert facts.failed[f"{TORCH_AUTOCAST}+refuses-badly"].startswith(
        "technique refuses-badly: its refuses raised ZeroDivisionError")
    assert not facts.reasons  # eager torch and autocast alone apply, and run


def test_a_technique_whose_changes_or_needs_are_not_sets_of_their_members_is_refused_naming_it():
    class Listed(Technique):
        changes = ["saving"]

    with pytest.raises(CombinationError, match=r"technique 'listed': changes must be a frozenset of Aspect members "
                                               r"\(FORWARD, SAVING, .*\), got \['saving'\]"):
        technique_registry({"listed": Listed})


@pytest.mark.slow
def test_a_run_with_a_faulty_technique_measures_every_other_engine_and_fails_that_ones_steps(tmp_path):
    import json

    from benchlib.records import load_records
    from benchlib.runner.cli import main

    path = tmp_path / "faulty_model.py"
    path.write_text(FAULTY)
    assert main(["run", str(path), "--quick", "-p", f"engines={TORCH},faulty,{TORCH_AUTOCAST}+refuses-badly,"
                 f"{TORCH_CHECKPOINT}[missing.block]", "--no-progress", "--out", str(tmp_path / "out")]) == 1  # partial:
    # the run measured, three failed (a misspelt module path is the request's error, never "not applicable")
    records = load_records(next((tmp_path / "out").iterdir()))
    failed = records[records["metric"] == "failed"]
    messages = dict(zip(failed["variant"], failed["params"].map(lambda params: json.loads(params)["message"])))
    assert messages == {"faulty": "technique faulty: its not_applicable raised KeyError: 'no such layer'",
                        f"{TORCH_AUTOCAST}+refuses-badly": "technique refuses-badly: its refuses raised "
                                                           "ZeroDivisionError: division by zero",
                        f"{TORCH_CHECKPOINT}[missing.block]": f"{TORCH_CHECKPOINT}[missing.block]: the model (Linear) "
                                                              "has no module missing.block; its blocks: none"}
    assert set(records.loc[records["metric"] == "peak_bytes", "variant"]) == {TORCH}
