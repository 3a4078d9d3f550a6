"""Several model files in one run (versions of one NAME, interleaved), compare across runs of one NAME,
`benchlib.profile` and notebooks/your_model.ipynb."""

import json
import textwrap
from pathlib import Path

import papermill
import pandas as pd
import pytest

import benchlib
from benchlib.records import load_records, load_run_info
from benchlib.report.plots.usermodel import memory_by_role, peak_frame, peak_intervals
from benchlib.runner.cli import main
from benchlib.runner.notebooks import find_project_notebooks, select_notebooks
from benchlib.usermodel import version_labels
from benchlib.usermodel.summary import summary_table
from test_usermodel import GOOD
from test_usermodel_arrays import RESIDUAL

# MEGABYTES alive in loss: the peak is dominated by a size RSS resolves exactly, not by the tiny model
MODEL = GOOD.replace("    return ((model(x) - y) ** 2).mean()", """    extra = torch.ones(MEGABYTES * 250_000)
    return ((model(x) - y) ** 2).mean() + extra.sum() * 0""")
ENGINES = ["-p", "engines=torch,torch.func"]


def version(folder: Path, name: str, megabytes: int) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(MODEL).replace("MEGABYTES", str(megabytes)))
    return path


@pytest.mark.slow
def test_files_of_one_name_are_one_benchmark_and_other_names_stay_apart(tmp_path):
    first, second = version(tmp_path, "v1.py", 16), version(tmp_path, "v2.py", 64)
    other = tmp_path / "other.py"
    other.write_text(textwrap.dedent(MODEL).replace('"tiny"', '"other"').replace("MEGABYTES", "1"))
    specs = select_notebooks([str(first), str(other), str(second)])
    assert [spec.name for spec in specs] == ["tiny", "other"]
    assert specs[0].sources == (first.resolve(), second.resolve())
    assert specs[0].notebook_parameters({}, {})["benchmark"] == [str(first.resolve()), str(second.resolve())]
    assert version_labels(["a/v1.py", "b/v1.py", "c/v2.py"]) == ["a/v1.py", "b/v1.py", "v2"]


@pytest.mark.slow
def test_two_versions_run_interleaved_with_a_summary_line_comparing_them(tmp_path, capsys):
    first, second = version(tmp_path, "v1.py", 16), version(tmp_path, "v2.py", 64)
    out = tmp_path / "out"
    assert main(["run", str(first), str(second), "--quick", *ENGINES, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (run,) = out.iterdir()
    records = load_records(run)
    assert set(records["case"]) == {"v1", "v2"} and set(records["variant"]) == {"torch", "torch.func"}
    params = records[records["metric"] == "peak_bytes"]["params"].map(json.loads)
    positions = {(p["version"], p["trial"], p["position"]) for p in params}
    # 2 versions x 2 engines x 2 trials, each child at its own position in one shuffled order
    assert sorted(position for _, _, position in positions) == list(range(8))
    assert {p["file"] for p in params} == {str(first.resolve()), str(second.resolve())}
    assert "v2 vs v1: torch peak ratio" in " ".join(printed.split())
    summary = summary_table(records)
    ratio = summary[(summary["version"] == "v2 vs v1") & (summary["engine"] == "torch")]["peak_ratio"].item()
    assert ratio > 2  # 48 MB more alive in v2's loss
    assert set(load_run_info(run)["model_files"]) == {"tiny/v1", "tiny/v2"}
    assert {f"tiny_{name}.json" for name in ("peak", "roles")} <= {p.name for p in (run / "figures").iterdir()}


@pytest.mark.slow
def test_versions_of_one_name_in_two_forms_are_refused_with_exit_2(tmp_path, capsys):
    torch_file = version(tmp_path, "v1.py", 1)
    array_file = tmp_path / "v2.py"
    array_file.write_text(textwrap.dedent(RESIDUAL).replace('"residual"', '"tiny"'))
    out = tmp_path / "out"
    assert main(["run", str(torch_file), str(array_file), "--quick", "--out", str(out)]) == 2 and not out.exists()
    error = capsys.readouterr().err
    assert error.startswith("benchlib: error: ") and "Traceback" not in error and error.count("\n") == 1
    assert f"{array_file.resolve()}: it is of the array form, v1.py of the torch form" in error


@pytest.mark.slow
def test_two_array_form_versions_run_interleaved_with_a_summary_line_comparing_them(tmp_path, capsys):
    first = tmp_path / "v1.py"
    first.write_text(textwrap.dedent(RESIDUAL))
    second = tmp_path / "v2.py"  # two more steps of the chain: more saved for the gradient
    second.write_text(textwrap.dedent(RESIDUAL).replace("STEPS = 3", "STEPS = 5"))
    out = tmp_path / "out"
    assert main(["run", str(first), str(second), "--quick", "--device", "cpu", "-p", "engines=torch,autograd",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (run,) = out.iterdir()
    records = load_records(run)
    assert set(records["case"]) == {"v1", "v2"} and set(records["variant"]) == {"torch", "autograd"}
    params = records[records["metric"] == "peak_bytes"]["params"].map(json.loads)
    assert sorted(p["position"] for p in params) == list(range(8))
    assert {p["version"] for p in params} == {"v1", "v2"}
    assert "v2 vs v1: torch peak ratio" in " ".join(printed.split()) and "roles" not in printed
    errors = records[records["metric"] == "grad_max_rel_err"]
    assert set(zip(errors["case"], errors["variant"])) == {("v1", "autograd"), ("v2", "autograd")}
    assert {p.name for p in (run / "figures").iterdir()} >= {"residual_peak.json"}


@pytest.mark.slow
def test_compare_flags_a_version_that_peaks_higher_with_exit_1(tmp_path, capsys):
    folders = [tmp_path / "a", tmp_path / "b"]
    runs = []
    for folder, megabytes in zip(folders, (16, 64)):
        folder.mkdir()
        out = tmp_path / f"out-{folder.name}"
        assert main(["run", str(version(folder, "model.py", megabytes)), "--quick", "-p", "engines=torch",
                     "--out", str(out)]) == 0
        runs += [str(path) for path in out.iterdir()]
    capsys.readouterr()
    assert main(["compare", *runs]) == 1
    assert "peak_bytes" in capsys.readouterr().out
    assert main(["compare", runs[1], runs[1]]) == 0


@pytest.mark.slow
def test_profile_returns_records_summary_and_figures(tmp_path):
    import torch

    def model(width):
        return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def batch(width):
        return torch.randn(4, 3), torch.randn(4, 1)

    def loss(model, x, y):
        return ((model(x) - y) ** 2).mean()

    profile = benchlib.profile({"model": model, "batch": batch, "loss": loss, "NAME": "inline",
                                "PARAMETERS": {"width": 8}}, engines=["torch"], quick=True, out=tmp_path, width=4)
    assert set(profile.records["benchmark"]) == {"inline"} and profile.path.parent == tmp_path
    assert json.loads(profile.records["params"].iloc[0])["width"] == 4
    assert profile.lines[0].startswith("torch") and "peak +" in profile.lines[0]
    assert set(profile.figures) == {"frontier", "peak", "roles"}


def test_figures_draw_every_version_and_engine_with_intervals():
    rows = []
    for case, scale in (("v1", 1.0), ("v2", 3.0)):
        for engine in ("torch", "torch.func"):
            for trial in range(3):
                params = json.dumps({"trial": trial})
                rows += [{"case": case, "variant": engine, "metric": metric, "value": value * scale, "params": params}
                         for metric, value in (("peak_bytes", 2e6 + trial * 1e4), ("role_saved_bytes", 1e6),
                                               ("role_gradient_bytes", 5e5), ("role_parameter_bytes", 3e5))]
    records = pd.DataFrame(rows)
    table = peak_frame(records)
    assert list(table["case"]) == ["v1", "v1", "v2", "v2"] and (table["low"] <= table["peak"]).all()
    assert [trace.name for trace in peak_intervals(records).data] == ["v1", "v2"]
    roles = memory_by_role(records)
    assert list(roles.data[0].x[0]) == ["v1", "v1", "v2", "v2"]
    assert roles.layout.yaxis.title.text == "memory (MB)"


@pytest.mark.slow
def test_the_your_model_notebook_runs_a_model_file_under_papermill(tmp_path):
    path = version(tmp_path, "model.py", 1)
    output = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(find_project_notebooks() / "your_model.ipynb"), str(output), kernel_name="python3",
                               cwd=str(find_project_notebooks()),
                               parameters={"device": "cpu", "results_dir": str(tmp_path / "run"),
                                           "model_file": str(path), "quick": True})
    text = output.read_text()
    assert "peak +" in text and "plotly" in text
    assert set(load_records(tmp_path / "run")["benchmark"]) == {"tiny"}
