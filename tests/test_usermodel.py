"""benchlib.usermodel: a model file in the torch form (the array form: test_usermodel_arrays.py), refused before anything runs when it is not one,
its engines' gradients and roles, and the file run end to end through the command."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchlib.engines.gradients import GRADIENT_TOLERANCE, max_relative_error
from benchlib.engine_names import FUSED_OPTIMIZER, TORCH, TORCH_CHECKPOINT, TORCH_FUNC
from benchlib.records import load_records, load_run_info
from benchlib.runner.cli import main
from benchlib.usermodel import load_model_file, read_model_file
from benchlib.engines.roles import LiveBytes
from benchlib.engines.techniques import BUILTIN as ALL_ENGINES, COMPILING as COMPILED, Step, StepFacts, combine, technique_registry
from benchlib.usermodel.loader import ModelFileError
from benchlib.usermodel.template import TEMPLATE

# The engines these tests pin; the memory techniques have their own (test_usermodel_techniques.py)
ENGINES = (TORCH, TORCH_FUNC, TORCH_CHECKPOINT, FUSED_OPTIMIZER)
PINNED = ("-p", "engines=" + ",".join(ENGINES))


def not_applicable(engine, model, has_optimizer, has_step=False, device_kind="cpu"):
    """Why `engine` cannot run `model`'s step, as a run's plan asks it."""
    return combine(engine, technique_registry()).not_applicable(model, StepFacts(has_optimizer, has_step, device_kind))

GOOD = """
import torch

NAME = "tiny"
PARAMETERS = {"width": 16, "n": 8}
QUICK = {"width": 4, "n": 3}

def model(width, n):
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

def batch(width, n):
    return torch.randn(n, 3), torch.randn(n, 1)

def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()
"""
OPTIMIZER = """
def optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
"""
# Not an nn.Sequential, and its one child takes two tensors: nothing torch-checkpoint can checkpoint.
BILINEAR = GOOD.replace("""    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))""",
                        """    return Outer(width)

class Outer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.pair = torch.nn.Bilinear(3, 3, 1)

    def forward(self, x):
        return self.pair(x, x)""")


def write(folder: Path, text: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def refusal(tmp_path, capsys, text, *extra, name="model.py"):
    path = write(tmp_path, text, name) if text is not None else tmp_path / name
    out = tmp_path / "out"
    code = main(["run", str(path), *extra, "--out", str(out)])
    error = capsys.readouterr().err
    assert code == 2 and not out.exists(), error
    assert error.startswith("benchlib: error: ") and "Traceback" not in error
    return error


@pytest.mark.slow
@pytest.mark.parametrize(("text", "name", "message"), [
    (None, "model.py", "model file {path} does not exist"),
    ("model = 1\n", "model.txt", "{path}: is not a Python file (.py)"),
    ("def model(:\n    pass\n", "model.py", "{path}: is not valid Python: invalid syntax (line 1)"),
    ("import torch\nx = 1 / 0\n", "model.py", "{path}: fails at import at line 2 (x = 1 / 0): ZeroDivisionError"),
    (GOOD.replace("def loss(", "def lost("), "model.py", "{path}: defines no loss function; the torch form is model"),
    (GOOD.replace("def loss(model, x, y):", "def loss():").replace("((model(x) - y) ** 2).mean()", "0"),
     "model.py", "{path}: loss() must accept (model, *batch)"),
    (GOOD.replace("def model(width, n):", "def model(width):"), "model.py",
     "{path}: model must accept every PARAMETERS name as a keyword argument, model(**params) (PARAMETERS: width, n)"),
    (GOOD.replace("def loss(model, x, y):", "def loss(model, x):"), "model.py",
     "loss(model, x) must accept (model, *batch); batch gives 2 tensor(s)"),
    (GOOD.replace('PARAMETERS = {"width": 16, "n": 8}', 'PARAMETERS = [16, 8]'), "model.py",
     "{path}: PARAMETERS must be a dict of parameter name -> value, got list"),
    (GOOD.replace('PARAMETERS = {"width": 16, "n": 8}', 'PARAMETERS = {"width": 16, "n": 8, "shape": None}')
     .replace("(width, n)", "(width, n, shape)"),
     "model.py", "{path}: PARAMETERS['shape'] = None: parameter shape: the default must be an int, float, bool, str"),
    (GOOD.replace("((model(x) - y) ** 2).mean()", "(model(x) - y) ** 2"), "model.py",
     "{path}: loss(model, *batch) must return a 0-dim tensor (e.g. .mean() of the per-sample losses), got a tensor "
     "of shape (3, 1)"),
    (GOOD.replace("((model(x) - y) ** 2).mean()", "((model(x) - y) ** 2).mean().item()"), "model.py",
     "{path}: loss(model, *batch) must return a 0-dim tensor (e.g. .mean() of the per-sample losses), got float"),
    (GOOD.replace("return torch.randn(n, 3), torch.randn(n, 1)", "return [1, 2]"), "model.py",
     "{path}: batch(**params) must return a tensor or a tuple of tensors, got a list of int, int"),
    (GOOD + "\nraise_here = 0\ndef model(width, n):\n    return 1 / raise_here\n", "model.py",
     "{path}, line 19, in model: return 1 / raise_here: model(**params) raised ZeroDivisionError"),
    (GOOD.replace("return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))",
                  "return torch.nn.Tanh()").replace("return torch.randn(n, 3), torch.randn(n, 1)",
                                                     "return torch.randn(n, 3, requires_grad=True), torch.randn(n, 3)"),
     "model.py", "{path}: model(**params) returns a Tanh with no parameter that requires grad"),
    ("def loss(xp, x):\n    return xp.sum(x * x)\n", "model.py", "{path}: loss(xp, ...) is the array form's, which "
     "also needs params and data functions: params(**params) -> tuple of NumPy arrays"),
])
def test_a_file_not_in_the_torch_form_is_refused_with_exit_2_naming_file_and_function(tmp_path, capsys, text, name, message):
    error = refusal(tmp_path, capsys, text, name=name)
    assert message.format(path=(tmp_path / name).resolve()) in error


@pytest.mark.slow
def test_versions_of_one_name_at_other_values_are_refused_and_debug_shows_the_traceback(tmp_path, capsys):
    first, second = write(tmp_path, GOOD, "a.py"), write(tmp_path, GOOD.replace('"width": 16', '"width": 17'), "b.py")
    out = tmp_path / "out"
    assert main(["run", str(first), str(second), "--out", str(out)]) == 2
    assert "PARAMETERS or QUICK differ from" in capsys.readouterr().err
    broken = write(tmp_path, "import torch\nx = 1 / 0\n", "broken.py")
    assert main(["run", str(broken), "--debug", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" in error and 'broken.py", line 2' in error and not out.exists()


@pytest.mark.slow
def test_parameters_are_typed_by_their_defaults_with_quick_values_and_trials(tmp_path, capsys):
    text = GOOD.replace('"n": 8}', '"n": 8, "sizes": [1, 2]}').replace("(width, n)", "(width, n, sizes)")
    benchmark = load_model_file(write(tmp_path, text))
    first_look = tuple(engine for engine in ALL_ENGINES if engine not in COMPILED)  # --quick: nothing that compiles
    assert benchmark.name == "tiny" and benchmark.quick == {"width": 4, "n": 3, "trials": 2, "engines": first_look,
                                                                "combinations": "none"}
    assert benchmark.parameter("sizes").default == (1, 2) and benchmark.defaults()["trials"] == 5
    assert main(["list", str(tmp_path / "model.py")]) == 0
    assert "width: int = 16  (quick: 4)" in capsys.readouterr().out


def test_the_example_from_benchlib_new_is_in_the_torch_form_and_never_overwritten(tmp_path, capsys):
    path = tmp_path / "example.py"
    assert main(["new", str(path)]) == 0 and path.read_text() == TEMPLATE
    assert load_model_file(path).name == "my_mlp"
    assert main(["new", str(path)]) == 2
    assert "exists; benchlib new never overwrites a file" in capsys.readouterr().err


def built(tmp_path, text):
    model_file = read_model_file(write(tmp_path, text))
    return model_file, model_file.build({"width": 16, "n": 8})


def test_engines_that_do_not_apply_say_why(tmp_path):
    model_file, (model, _) = built(tmp_path, BILINEAR)
    assert not_applicable(TORCH_CHECKPOINT, model, has_optimizer=True).startswith(
        "the model (Outer) is not an nn.Sequential, holds no nn.Sequential or nn.ModuleList of two blocks or more")
    assert not_applicable(FUSED_OPTIMIZER, model, has_optimizer=False).startswith(
        "the file declares no optimizer(parameters)")
    assert not_applicable(TORCH_FUNC, model, has_optimizer=False) is None


class _Stack(torch.nn.Module):
    """A stem, repeated blocks (an nn.Sequential or an nn.ModuleList called in a loop) and a head."""

    def __init__(self, blocks: int, as_list: bool):
        super().__init__()
        layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(blocks)]
        self.stem, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.blocks = torch.nn.ModuleList(layers) if as_list else torch.nn.Sequential(*layers)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks if isinstance(self.blocks, torch.nn.ModuleList) else (self.blocks,):
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("as_list, plan, checkpointed", [
    (False, "checkpoint_sequential of blocks, 3 segments of 9 modules", 2),  # torch runs the last segment plainly
    (True, "checkpoint of each of the 9 blocks of blocks (nn.ModuleList)", 9)])
def test_torch_checkpoint_segments_a_models_repeated_blocks(monkeypatch, as_list, plan, checkpointed):
    from torch.utils import checkpoint as torch_checkpoint

    from benchlib.engines.techniques.modules import checkpoint_params

    calls = []
    original = torch_checkpoint.checkpoint
    monkeypatch.setattr(torch_checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    gradients = {}
    for engine in (TORCH, TORCH_CHECKPOINT):
        torch.manual_seed(0)
        model, batch = _Stack(9, as_list), (torch.randn(5, 4), torch.randn(5, 1))
        assert checkpoint_params(model)["checkpoint"] == plan
        step = Step(engine, model, batch, lambda m, x, y: ((m(x) - y) ** 2).mean(), None)
        captured = {}
        with step.observe(lambda name, g: captured.__setitem__(name, g.detach().clone())):
            step()
        gradients[engine] = [captured[name] for name, _ in step.named]
    assert len(calls) == checkpointed  # checkpoint_sequential's segments, or one per block
    assert max_relative_error(gradients[TORCH_CHECKPOINT], gradients[TORCH]) <= 1e-6


def test_every_engine_computes_eager_torchs_gradient_and_frees_gradients_as_it_says(tmp_path):
    model_file, _ = built(tmp_path, GOOD + OPTIMIZER)
    gradients, peaks = {}, {}
    for engine in ENGINES:
        model, batch = model_file.build({"width": 16, "n": 8})
        step, captured, live = Step(engine, model, batch, model_file.loss, model_file.optimizer), {}, LiveBytes()
        with step.observe(lambda name, g: (captured.__setitem__(name, g.detach().clone()), live.add(name, g))):
            step()
        gradients[engine] = [captured[name] for name, _ in step.named]
        peaks[engine] = live.peak_bytes
        assert all(p.grad is None for _, p in step.named)  # a step ends holding no gradient
    for engine in ENGINES:
        assert max_relative_error(gradients[engine], gradients[TORCH]) <= GRADIENT_TOLERANCE["float32"]
    sizes = [p.numel() * 4 for p in model_file.build({"width": 16, "n": 8})[0].parameters()]
    assert peaks[TORCH] == peaks[TORCH_FUNC] == sum(sizes)  # every gradient at once
    assert peaks[FUSED_OPTIMIZER] == max(sizes)  # one gradient at a time, freed after its step


def benchlib(*args, cwd):
    return subprocess.run([sys.executable, "-m", "benchlib.runner.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_a_content_a_form_check_passed_is_not_checked_again_and_an_edited_file_is(tmp_path):
    """The runner's reading child checks the file; the kernel given that content's digest does not call it again."""
    from benchlib.records.environment import file_digest
    from benchlib.usermodel import load_model_files

    counting = GOOD.replace("def loss(model, x, y):\n", "def loss(model, x, y):\n    CALLS.write_text(CALLS.read_text() + 'x')\n")
    path = write(tmp_path, "from pathlib import Path\nCALLS = Path(__file__).with_name('calls.txt')\n" + counting)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    load_model_files([path])
    assert calls.read_text() == "x"  # checked: one loss call
    load_model_files([path], checked={str(path.resolve()): file_digest(path)})
    assert calls.read_text() == "x"  # the content already passed: not called again
    load_model_files([path], checked={str(path.resolve()): "0" * 64})
    assert calls.read_text() == "xx"  # another content (the file was edited since): checked again


@pytest.mark.slow
def test_a_model_file_runs_end_to_end_with_quick(tmp_path):
    write(tmp_path, GOOD + OPTIMIZER)
    done = benchlib("run", "model.py", "--quick", *PINNED, "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    run = next((tmp_path / "out").iterdir())
    records = load_records(run)
    assert set(records["variant"]) == set(ENGINES) and set(records["benchmark"]) == {"tiny"}
    for engine in ENGINES:
        rows = records[records["variant"] == engine]
        assert {"peak_bytes", "time", "alloc_count", "alloc_count_python", "gc_time", "role_parameter_bytes",
                "role_gradient_bytes"} <= set(rows["metric"]), engine
        harness = rows[rows["metric"].str.startswith("harness_")]  # where each trial's time went, phase by phase
        assert set(harness["metric"]) == {"harness_process_time", "harness_setup_time", "harness_warmup_time",
                                          "harness_timed_time", "harness_allocation_pass_time", "harness_check_time"}
        assert (harness.groupby("metric").size() == 2).all() and (harness["value"] >= 0).all()
        trials = rows[rows["metric"] != "trials_run"]  # the stopping record is per engine, not per trial
        assert {json.loads(p)["trial"] for p in trials["params"]} == {0, 1}
        (stop,) = rows.loc[rows["metric"] == "trials_run", "params"].map(json.loads)
        assert stop["stop"] == "max_trials"  # two trials, the quick cap: below the three an interval needs
        assert {json.loads(p)["width"] for p in rows["params"]} == {4}
        modules = rows[rows["metric"] == "module_bytes"]  # memory by module, beside the role totals, per trial
        for trial, of_trial in modules.groupby(modules["params"].map(lambda p: json.loads(p)["trial"])):
            params = of_trial["params"].map(json.loads)
            assert {p["module_depth"] for p in params} == {2}
            gradients = rows[(rows["metric"] == "role_gradient_bytes")
                             & (rows["params"].map(lambda p: json.loads(p).get("trial")) == trial)]["value"]
            assert of_trial[[p["role"] == "gradients" for p in params]]["value"].sum() == gradients.iloc[0]
    errors = records[records["metric"] == "grad_max_rel_err"]
    assert set(errors["variant"]) == set(ENGINES) - {TORCH} and (errors["value"] <= 1e-3).all()
    provenance = load_run_info(run)["model_files"]["tiny"]
    assert provenance["path"] == str((tmp_path / "model.py").resolve())
    import hashlib
    assert provenance["sha256"] == hashlib.sha256((tmp_path / "model.py").read_bytes()).hexdigest()
    executed = json.loads(next((run / "notebooks").iterdir()).read_text())  # the kernel was told what was checked
    injected = "".join("".join(cell["source"]) for cell in executed["cells"]
                       if "injected-parameters" in cell["metadata"].get("tags", []))
    assert f'checked = {{"{(tmp_path / "model.py").resolve()}": "{provenance["sha256"]}"}}' in injected.replace("'", '"')
    summary = done.stdout[done.stdout.index("tiny:\n"):].splitlines()[1:5]  # the summary first, one line per engine
    assert [line.split()[0] for line in summary] == list(ENGINES)
    assert all(" peak +" in line and "/step" in line and "largest module " in line for line in summary)


@pytest.mark.slow
def test_an_error_in_the_users_code_fails_that_case_and_keeps_the_others(tmp_path):
    # an optimizer factory that assumes it gets every parameter: fused-optimizer makes one per parameter
    text = GOOD + OPTIMIZER.replace("    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)",
                                    "    parameters = list(parameters)\n    assert len(parameters) > 1, 'one optimizer for "
                                    "the whole model'\n    return torch.optim.SGD(parameters, lr=0.1)")
    write(tmp_path, text)
    done = benchlib("run", "model.py", "--quick", "-p", "trials=1", *PINNED, "--device", "cpu", "--out", "out",
                    cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    records = load_records(next((tmp_path / "out").iterdir()))
    status = {row.variant: (row.metric, json.loads(row.params)["message"])
              for row in records[records["metric"].isin(["failed", "not_applicable"])].itertuples()}
    assert set(status) == {FUSED_OPTIMIZER} and status[FUSED_OPTIMIZER][0] == "failed"
    line = (tmp_path / "model.py").read_text().splitlines().index("    assert len(parameters) > 1, 'one optimizer for "
                                                                   "the whole model'") + 1
    assert f"{(tmp_path / 'model.py').resolve()}, line {line}, in optimizer" in status[FUSED_OPTIMIZER][1]
    assert {TORCH, TORCH_FUNC, TORCH_CHECKPOINT} <= set(records[records["metric"] == "time"]["variant"])


@pytest.mark.slow
def test_an_engine_that_cannot_run_the_users_code_is_not_applicable_and_the_run_stays_ok(tmp_path):
    # .numpy() works in eager torch but not under torch.func.grad: torch.func's limit, not the file's error
    text = BILINEAR.replace("return ((model(x) - y) ** 2).mean()",
                            "value = ((model(x) - y) ** 2).mean()\n    value.detach().numpy()\n    return value")
    write(tmp_path, text)
    done = benchlib("run", "model.py", "--quick", "-p", "trials=1", "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = load_records(next((tmp_path / "out").iterdir()))
    status = {row.variant: (row.metric, json.loads(row.params)["message"])
              for row in records[records["metric"].isin(["failed", "not_applicable"])].itertuples()}
    assert status[TORCH_FUNC] == ("not_applicable", "torch.func cannot transform this step: Cannot access data "
                                                    "pointer of Tensor that doesn't have storage")
    assert status[TORCH_CHECKPOINT][0] == status[FUSED_OPTIMIZER][0] == "not_applicable"
    assert "time" in set(records[records["variant"] == TORCH]["metric"])
    assert "torch.func not applicable: torch.func cannot transform this step" in " ".join(done.stdout.split())


def test_a_lowest_peak_of_zero_bytes_gives_no_ratio_instead_of_failing_the_run():
    from benchlib.records import make_record, records_frame
    from benchlib.usermodel.summary import summary_table

    def rows(engine, peaks):
        return [make_record(benchmark="tiny", case="step", engine=engine, device="cpu", dtype="float32", metric=metric,
                            value=value, params={"trial": trial})
                for trial, peak in enumerate(peaks) for metric, value in (("peak_bytes", peak), ("time", 1e-3))]

    table = summary_table(records_frame(rows(TORCH, [4096.0, 8192.0]) + rows(FUSED_OPTIMIZER, [0.0, 0.0])))
    lines = dict(zip(table["engine"], table["summary"]))
    assert "no ratio (the lowest peak is 0" in lines[TORCH] and "lowest" in lines[FUSED_OPTIMIZER]
    assert table["peak_ratio"].isna().all()


def test_below_the_resident_resolution_the_ratio_is_of_the_tracked_peaks():
    from benchlib.records import make_record, records_frame
    from benchlib.usermodel.summary import summary_table

    def rows(engine, peak, tracked):
        return [make_record(benchmark="tiny", case="step", engine=engine, device="cpu", dtype="float32", metric=metric,
                            value=value, params={"trial": trial})
                for trial in range(3) for metric, value in
                (("peak_bytes", peak), ("tracked_peak_bytes", tracked), ("time", 1e-3))]

    table = summary_table(records_frame(rows(TORCH, 0.0, 30_000.0) + rows(FUSED_OPTIMIZER, 4096.0, 45_000.0)))
    lines = dict(zip(table["engine"], table["summary"]))
    assert "(tracked 30.00 kB)  best by tracked peak" in lines[TORCH]
    assert "(tracked 45.00 kB)  1.50x [1.50, 1.50] the best by tracked peak" in lines[FUSED_OPTIMIZER]
