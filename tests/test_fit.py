"""`benchlib fit`: size models chosen by the point they predict, the largest fitting value, the answer, refusals
before any work, exit codes, and a real fit whose prediction is checked against a real measurement."""

import json
import math
import textwrap

import numpy as np
import pytest

from benchlib.records import load_records, load_run_info
from benchlib.runner.cli import main
from benchlib.usermodel import fit as fitting
from benchlib.usermodel.loader import read_model_file
from benchlib.usermodel.fit import LINEAR, QUADRATIC, SEARCH_LIMIT, FitError, choose_model, fit, scale_points
from test_usermodel import GOOD

MB = 1e6


def model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(GOOD))
    return path


def fake_measure(totals):
    """`_measure` replaced: engine -> total(n) in bytes; time 1 ms per sample."""
    def measure(_model_file, engine, values, _device):
        total = totals.get(engine)
        return "not applicable: on purpose" if total is None else (int(total(values["n"])), values["n"] * 1e-3)
    return measure


def test_a_linear_total_is_fitted_linear_and_a_quadratic_one_quadratic():
    values = [2, 4, 8, 16]
    linear = choose_model(values, [100 + 10 * v for v in values])
    assert linear.kind == LINEAR and linear.check_error < 1e-9 and linear(100) == pytest.approx(1100)
    quadratic = choose_model(values, [100 + 2 * v + 3 * v * v for v in values])
    assert quadratic.kind == QUADRATIC and quadratic(32) == pytest.approx(100 + 64 + 3072)
    assert choose_model([2, 4, 8], [1, 2, 3]).kind == LINEAR  # three points: nothing to check a quadratic on
    assert linear.largest_under(1100.5, 2) == 100 and linear.largest_under(50, 2) is None
    assert choose_model(values, [500] * 4).largest_under(1000, 2) == SEARCH_LIMIT  # a total that does not grow


def test_the_points_are_fractions_of_the_value_given_and_too_few_are_refused():
    assert scale_points(64, "batch") == [8, 16, 32, 64]
    assert scale_points(3, "batch") == [1, 2, 3]
    with pytest.raises(FitError, match="only 2 distinct values"):
        scale_points(2, "batch")
    with pytest.raises(FitError, match="is an integer"):
        scale_points(0.5, "lr")


def test_the_best_engine_fits_the_largest_value_and_the_others_say_what_they_give_up(tmp_path, monkeypatch):
    monkeypatch.setattr(fitting, "_measure", fake_measure({"torch": lambda n: 100 * MB + n * MB,
                                                           "torch-checkpoint": lambda n: 100 * MB + n * MB / 4}))
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch", "torch-checkpoint", "torch.func"],
                 params={"n": 64}, progress=lambda line: None)
    by_engine = {engine_fit.engine: engine_fit for engine_fit in result.engines}
    assert by_engine["torch"].max_fitting == 100 and by_engine["torch-checkpoint"].max_fitting == 402
    assert result.best.engine == "torch-checkpoint"
    assert "not applicable: on purpose" in by_engine["torch.func"].reason
    lines = result.lines()
    assert lines[0] == ("tiny: the largest n under 200.6 MB (the process's resident high-water mark) is 402, with "
                        "torch-checkpoint (1.000 ms per sample, measured at 64)")
    assert "up to n=100" in lines[1] and "linear model" in lines[1]
    records = result.records()
    assert {row["metric"] for row in records} >= {"fit_total_bytes", "predicted_total_bytes", "max_fitting",
                                                   "fit_check_error"}


@pytest.mark.parametrize("argv, message", [
    (["--memory", "lots", "--scale", "n"], "not a memory size"),
    (["--memory", "1 GB", "--scale", "batch"], "'batch' is not a parameter of tiny.py; its parameters: width, n"),
    (["--memory", "1 GB", "--scale", "n", "--engines", "torch,jax"], "unknown engine(s) jax"),
    (["--memory", "1 GB", "--scale", "n", "-p", "n=2"], "only 2 distinct values"),
])
def test_bad_input_is_refused_with_exit_2_before_anything_is_measured(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(fitting, "_measure", None)  # any measurement would raise
    assert main(["fit", str(model_file(tmp_path)), *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_exit_0_when_an_engine_fits_and_1_when_none_fits_at_the_smallest_value(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fitting, "_measure", fake_measure({"torch": lambda n: 100 * MB + n * MB}))
    path = str(model_file(tmp_path))
    assert main(["fit", path, "--memory", "150 MB", "--scale", "n", "--engines", "torch", "-p", "n=16",
                 "--out", str(tmp_path / "out")]) == 0
    (run,) = (tmp_path / "out").iterdir()
    assert set(load_records(run)["metric"]) >= {"fit_total_bytes", "max_fitting"}
    assert load_run_info(run)["notebooks"]["tiny_fit"]["benchmarks"] == ["tiny"]
    page = (run / "report.html").read_text()
    assert "the largest n under 150.0 MB" in page and "data-name='tiny_fit'" in page
    assert main(["fit", path, "--memory", "50 MB", "--scale", "n", "--engines", "torch", "-p", "n=16",
                 "--out", str(tmp_path / "out2")]) == 1
    assert "no engine fits 50.00 MB" in capsys.readouterr().out


@pytest.mark.slow
def test_a_real_fit_predicts_the_measured_total_at_twice_the_largest_point(tmp_path):
    path = tmp_path / "wide.py"
    path.write_text(textwrap.dedent(GOOD).replace('"width": 16, "n": 8', '"width": 1024, "n": 16384'))
    result = fit(path, memory="100 GB", scale="n", engines=["torch"], params={"n": 16384}, progress=lambda line: None)
    (torch_fit,) = result.engines
    measured, _seconds = fitting._measure(read_model_file(path), "torch", {"width": 1024, "n": 32768}, fitting_device())
    assert math.isfinite(torch_fit.model.check_error)
    assert abs(torch_fit.model(32768) - measured) / measured < 0.10


def fitting_device():
    from benchlib.measure import resolve_device

    return resolve_device("cpu")
