"""The array form of a model file: the ops it may use (their VJPs against torch.autograd, on NumPy and
torch inputs), refusals before anything runs, and a file run end to end under every engine."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from benchlib.autodiff import ACCUMULATE_MODES, grad, ops
from benchlib.engines import namespaces

# (name, benchlib's loss over ops, the same loss in torch): each new op, with broadcasting, ties, repeats.
OP_CASES = [
    ("sqrt", lambda a, b: ops.sum(ops.sqrt(a * a + 1.0) * b), lambda a, b: (torch.sqrt(a * a + 1) * b).sum()),
    ("max axis", lambda a, b: ops.sum(ops.max(a, axis=1) * ops.sum(b, axis=1)),
     lambda a, b: (torch.amax(a, 1) * b.sum(1)).sum()),
    ("max keepdims", lambda a, b: ops.sum(ops.max(a, axis=0, keepdims=True) * b),
     lambda a, b: (torch.amax(a, 0, keepdim=True) * b).sum()),
    ("max all", lambda a, b: ops.max(a * b), lambda a, b: torch.amax(a * b)),
    ("max ties", lambda a, b: ops.sum(ops.max(ops.maximum(a, 0.5), axis=1) * b[:, 0]),
     lambda a, b: (torch.amax(torch.clamp_min(a, 0.5), 1) * b[:, 0]).sum()),
    ("where", lambda a, b: ops.sum(ops.where(a > 0, a * b, b * b)), lambda a, b: torch.where(a > 0, a * b, b * b).sum()),
    ("where scalar", lambda a, b: ops.sum(ops.where(a > b, a, 0.0) * b),
     lambda a, b: (torch.where(a > b, a, 0.0) * b).sum()),
    ("concatenate", lambda a, b: ops.sum(ops.tanh(ops.concatenate([a, b, a], axis=1)) * ops.concatenate([b, a, b], 1)),
     lambda a, b: (torch.tanh(torch.cat([a, b, a], 1)) * torch.cat([b, a, b], 1)).sum()),
    ("stack", lambda a, b: ops.sum(ops.tanh(ops.stack([a, b, a], axis=-1)) * ops.stack([b, b, a], -1)),
     lambda a, b: (torch.tanh(torch.stack([a, b, a], -1)) * torch.stack([b, b, a], -1)).sum()),
    ("index repeated", lambda a, b: ops.sum(a[np.array([0, 2, 0]), 1:] * b[:, :3]),
     lambda a, b: (a[[0, 2, 0], 1:] * b[:, :3]).sum()),
    ("index basic and .T", lambda a, b: ops.sum(a[1] * b[2]) + ops.sum(a.T[0] * a.T[0]),
     lambda a, b: (a[1] * b[2]).sum() + (a.T[0] * a.T[0]).sum()),
    ("index boolean", lambda a, b: ops.sum(a[b > 0] ** 2), lambda a, b: (a[b > 0] ** 2).sum()),
]


def torch_gradient(torch_loss, a, b):
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    grads = torch.autograd.grad(torch_loss(ta, tb), [ta, tb], allow_unused=True)
    return [np.zeros_like(x) if g is None else g.numpy() for g, x in zip(grads, (a, b))]


@pytest.mark.parametrize("mode", ACCUMULATE_MODES)
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize(("name", "loss", "torch_loss"), OP_CASES, ids=[case[0] for case in OP_CASES])
def test_new_ops_vjps_match_torch_autograd(name, loss, torch_loss, library, mode):
    rng = np.random.default_rng(len(name))
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    inputs = (a, b) if library == "numpy" else (torch.tensor(a), torch.tensor(b))
    got = grad(loss, (0, 1), accumulate=mode)(*inputs)
    for g, want in zip(got, torch_gradient(torch_loss, a, b)):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize(("name", "loss", "torch_loss"), OP_CASES[:4], ids=[case[0] for case in OP_CASES[:4]])
def test_new_ops_vjps_match_finite_differences(name, loss, torch_loss):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ga = grad(loss, 0, checkpoint="sqrt")(a, b)
    step, numeric = 1e-6, np.zeros_like(a)
    for index in np.ndindex(a.shape):
        up, down = a.copy(), a.copy()
        up[index] += step
        down[index] -= step
        numeric[index] = (float(loss(up, b)) - float(loss(down, b))) / (2 * step)
    np.testing.assert_allclose(ga, numeric, rtol=1e-5, atol=1e-7)


def test_every_namespace_computes_the_new_ops_alike():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    spaces = {"numpy": namespaces.numpy_namespace(), "autograd": namespaces.autograd_namespace(),
              "torch": namespaces.torch_namespace(), "benchlib": ops}
    calls = [("sqrt", lambda xp, x, y: xp.sqrt(x * x)), ("max", lambda xp, x, y: xp.max(x, axis=1, keepdims=True)),
             ("max", lambda xp, x, y: xp.max(x)), ("where", lambda xp, x, y: xp.where(x > y, x, 0.0)),
             ("concatenate", lambda xp, x, y: xp.concatenate([x, y], axis=-1)),
             ("stack", lambda xp, x, y: xp.stack([x, y], axis=1)),
             ("arange", lambda xp, x, y: x[xp.arange(2), xp.arange(1, 3)])]
    for name, call in calls:
        want = call(np, a, b)
        for space_name, xp in spaces.items():
            x, y = (torch.tensor(a), torch.tensor(b)) if space_name == "torch" else (a, b)
            np.testing.assert_allclose(np.asarray(call(xp, x, y)), want, err_msg=f"{name} in {space_name}")


RESIDUAL = """
import numpy as np

NAME = "residual"
PARAMETERS = {"width": 16, "steps": 4, "n": 8}
QUICK = {"width": 6, "steps": 3, "n": 4}
STEPS = 3


def params(width, steps, n):
    return (np.random.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), \\
        np.zeros((width, 1), np.float32)


def data(width, steps, n):
    return (np.random.standard_normal((width, n)).astype(np.float32),)


def loss(xp, W, b, z):
    for _ in range(STEPS):  # a residual chain: z = tanh(W z + b) + z / 2
        z = xp.tanh(W @ z + b) + 0.5 * z
    return xp.mean(z * z)
"""


def write(folder: Path, text: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("text", "message"), [
    (RESIDUAL.replace("def data(", "def dat("), "{path}: defines params but no data function; the array form is params"),
    (RESIDUAL.replace("def params(width, steps, n):", "def params(width):"),
     "{path}: params must accept every PARAMETERS name as a keyword argument, params(**params) (PARAMETERS: width, "
     "steps, n)"),
    (RESIDUAL.replace("def loss(xp, W, b, z):", "def loss(*arrays):\n    xp, W, b, z = arrays"),
     "{path}: loss(*arrays) must accept (xp, *params, *data)"),
    (RESIDUAL.replace("def loss(xp, W, b, z):", "def loss(xp, W, z):"),
     "loss(xp, W, z) must accept (xp, *params, *data); they give 2 + 1 array(s)"),
    (RESIDUAL.replace("return (np.random.standard_normal((width, n)).astype(np.float32),)", "return [1.0]"),
     "{path}: data(**params) must return a tuple of NumPy arrays, got a list of float"),
    (RESIDUAL.replace("np.zeros((width, 1), np.float32)", "np.zeros((width, 1))"),
     "{path}: params(**params) must return arrays of one dtype, float32 or float64; got float32, float64"),
    (RESIDUAL.replace("return xp.mean(z * z)", "return z * z"),
     "{path}: loss(xp, *params, *data) must return a scalar array (e.g. xp.mean of the per-sample losses; never "
     "float() or .item(), which no engine can differentiate), got an array of shape (6, 4)"),
    (RESIDUAL.replace("return xp.mean(z * z)", "return float(xp.mean(z * z))"),
     "must return a scalar array (e.g. xp.mean of the per-sample losses; never float() or .item(), which no engine "
     "can differentiate), got float"),
    (RESIDUAL.replace("xp.tanh(", "xp.arctanh("), "{path}: loss uses xp.arctanh, which no engine offers (each offers "
     "dot, matmul, tanh"),
    (RESIDUAL.replace("return xp.mean(z * z)", "return xp.mean(z * z) / 0 if z.shape[0] < 0 else xp.mean(z[99])"),
     "{path}, line 22, in loss: return xp.mean(z * z) / 0 if z.shape[0] < 0 else xp.mean(z[99]): loss(xp, *params, "
     "*data) over NumPy raised IndexError"),
])
def test_a_file_not_in_the_array_form_is_refused_with_exit_2_before_anything_runs(tmp_path, capsys, text, message):
    from benchlib.runner.cli import main

    path, out = write(tmp_path, text), tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2 and not out.exists()
    error = capsys.readouterr().err
    assert error.startswith("benchlib: error: ") and "Traceback" not in error and error.count("\n") == 1
    assert message.format(path=path.resolve()) in error


def test_an_xp_name_only_some_engines_lack_makes_those_engines_not_applicable(tmp_path):
    from benchlib.usermodel import arrays
    from benchlib.usermodel.arrays import ARRAY_ENGINES, ARRAY_FORM_RUN, lacking, read_array_file

    assert lacking({"tanh", "where", "stack"}) == {}
    model_file = read_array_file(write(tmp_path, RESIDUAL))
    plan = ARRAY_FORM_RUN.facts(model_file, {"width": 6, "steps": 3, "n": 4}, "cpu")
    assert plan.dtype == "float32" and plan.reasons == {}
    torch_only = namespaces.torch_namespace()
    torch_only.cosh = torch.cosh  # an xp name only torch's engines would have: the others say they lack it
    spaces = {engine: torch_only if engine in ("torch", "torch.func") else arrays.engine_namespace(engine)
              for engine in ARRAY_ENGINES}
    assert arrays.lacking({"cosh", "tanh"}, spaces) == {engine: ["cosh"] for engine in ARRAY_ENGINES
                                                         if engine not in ("torch", "torch.func")}


def benchlib(*args, cwd):
    return subprocess.run([sys.executable, "-m", "benchlib.runner.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_a_residual_numpy_chain_runs_end_to_end_under_every_engine(tmp_path):
    from benchlib.engines.gradients import GRADIENT_TOLERANCE
    from benchlib.records import load_records
    from benchlib.usermodel.arrays import ARRAY_ENGINES

    write(tmp_path, RESIDUAL)
    done = benchlib("run", "model.py", "--quick", "--device", "cpu", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = load_records(next((tmp_path / "out").iterdir()))
    assert set(records["variant"]) == set(ARRAY_ENGINES) and set(records["dtype"]) == {"float32"}
    for engine in ARRAY_ENGINES:
        rows = records[records["variant"] == engine]
        assert {"peak_bytes", "time", "alloc_count", "gc_time"} <= set(rows["metric"]), engine
        trials = rows[rows["metric"] != "trials_run"]  # the stopping record is per engine, not per trial
        assert {json.loads(p)["trial"] for p in trials["params"]} == {0, 1}
        (stop,) = rows.loc[rows["metric"] == "trials_run", "params"].map(json.loads)
        assert stop["stop"] == "max_trials"  # two trials, the quick cap: below the three an interval needs
        assert {json.loads(p)["width"] for p in rows["params"]} == {6}
    errors = records[records["metric"] == "grad_max_rel_err"]
    assert set(errors["variant"]) == set(ARRAY_ENGINES) - {"torch"}
    assert (errors["value"] <= GRADIENT_TOLERANCE["float32"]).all(), errors
    summary = done.stdout[done.stdout.index("residual:\n"):].splitlines()[1:1 + len(ARRAY_ENGINES)]
    assert [line.split()[0] for line in summary] == list(ARRAY_ENGINES)
    assert all(" peak +" in line and "/step" in line for line in summary)


def test_benchlib_new_writes_an_array_form_example_every_engine_differentiates_alike(tmp_path, capsys):
    from benchlib.engines.gradients import GRADIENT_TOLERANCE, load_gradient, max_relative_error
    from benchlib.measure import resolve_device
    from benchlib.runner.cli import main
    from benchlib.usermodel import load_model_file
    from benchlib.usermodel.array_case import case
    from benchlib.usermodel.arrays import ARRAY_ENGINES
    from benchlib.usermodel.template import ARRAY_TEMPLATE

    path = tmp_path / "mine.py"
    assert main(["new", str(path), "--form", "arrays"]) == 0 and path.read_text() == ARRAY_TEMPLATE
    benchmark = load_model_file(path)
    assert benchmark.name == "my_regression" and "gradient of the loss" in benchmark.cases
    values = {p.name: p.quick for p in benchmark.parameters if p.name not in ("trials", "precision", "engines", "attribute")}
    for engine in ARRAY_ENGINES:  # the child's case, in this process: its step and the gradient its check saves
        step = case(device=resolve_device("cpu"), path=str(path), engine=engine, values=values,
                    gradient_dir=str(tmp_path))
        roles = {"role_saved_bytes", "role_gradient_bytes"} if engine.startswith("benchlib-") else set()
        assert set(step.check(step.fn())) == roles  # benchlib's engines read roles off their tape
    reference = load_gradient(tmp_path, "torch")
    assert [g.shape for g in reference] == [(8, 16), (16,), (16, 1), (1,)]
    for engine in ARRAY_ENGINES:
        gradient = load_gradient(tmp_path, engine)
        assert all(g.dtype == np.float32 for g in gradient), engine
        assert max_relative_error(gradient, reference) <= GRADIENT_TOLERANCE["float32"], engine
