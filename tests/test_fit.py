"""`benchlib fit`: size models chosen by the point they predict, the largest fitting value, the answer, refusals
before any work, exit codes, and a real fit whose prediction is checked against a real measurement."""

import dataclasses
import json
import math
import re
import textwrap

import numpy as np
import pytest

from benchlib.records import load_records, load_run_info
from benchlib.records.store import list_runs
from benchlib.runner.cli import main
from benchlib.fit import measured
from benchlib.fit.asking import FitError, MemoryLimit, scale_points
from benchlib.fit.largest import fit
from benchlib.fit.measured import StepOutcome
from benchlib.fit.result import EngineFit
from benchlib.fit.settings import THOROUGH
from benchlib.fit.search import SEARCH_LIMIT
from benchlib.fit.sizing import LINEAR, QUADRATIC, TRACE, SizeModel, choose_model, trace_model
from benchlib.fit.tracing import traced_peak, tracked_peak
from benchlib.usermodel.loader import read_model_file
from test_usermodel import GOOD

MB = 1e6
NO_VERIFY = THOROUGH.verifying(False)  # the size model's answers, unconfirmed
VERIFY = THOROUGH.verifying(True)


def model_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(GOOD))
    return path


def fake_measure(totals):
    """`_measure` replaced: engine -> total(n) in bytes; time 1 ms per sample."""
    def measure(_model_file, engine, values, _device, **_options):
        total = totals.get(engine)
        return (StepOutcome(reason="not applicable: on purpose") if total is None
                else StepOutcome(int(total(values["n"])), values["n"] * 1e-3))
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


def test_a_quadratic_that_turns_down_is_never_chosen():
    values = [8, 16, 32, 64]
    totals = [100.0, 150.0, 180.0, 185.0]  # flattening: a parabola through them turns down past 64
    model = choose_model(values, totals)
    assert model.kind == LINEAR and model.largest_under(1000.0, 64) < SEARCH_LIMIT


def test_the_points_are_fractions_of_the_value_given_and_too_few_are_refused():
    assert scale_points(64, "batch") == [8, 16, 32, 64]
    assert scale_points(3, "batch") == [1, 2, 3]
    with pytest.raises(FitError, match="only 2 distinct values"):
        scale_points(2, "batch")
    with pytest.raises(FitError, match="is an integer"):
        scale_points(0.5, "lr")


def test_the_best_engine_fits_the_largest_value_and_the_others_say_what_they_give_up(fit_children_here, tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB,
                                                           "torch-checkpoint": lambda n: 100 * MB + n * MB / 4}))
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch", "torch-checkpoint", "torch.func"],
                 params={"n": 64}, search=NO_VERIFY, progress=lambda line: None)
    by_engine = {engine_fit.engine: engine_fit for engine_fit in result.engines}
    assert by_engine["torch"].max_fitting == 100 and by_engine["torch-checkpoint"].max_fitting == 402
    assert result.best.engine == "torch-checkpoint"
    assert "not applicable: on purpose" in by_engine["torch.func"].reason
    # measured toward the answer in one step, to where it lies a little less than twice past the point measured
    assert [value for value, _, _ in by_engine["torch-checkpoint"].points] == [8, 16, 32, 64, 252]
    assert [value for value, _, _ in by_engine["torch"].points] == [8, 16, 32, 64]  # 100 is within 2x of 64
    lines = result.lines()
    assert lines[0] == ("tiny: the largest n under 200.6 MB (the process's resident high-water mark) is 402, with "
                        "torch-checkpoint (1.000 ms per sample, measured at 252); predicted, extrapolated 1.60x past "
                        "the largest measured value (252), read from its size model's upper bound (+0.0%)")
    assert lines[1].startswith("tiny: the fastest at n=100, the largest every fitting engine reaches, is torch")
    torch_line = next(line for line in lines if line.startswith("  torch "))
    assert "up to n=100: 200.0 MB" in torch_line and "predicted, extrapolated 1.56x" in torch_line
    assert "model, 0.0% out of sample)" in torch_line
    records = result.records()
    assert {row["metric"] for row in records} >= {"fit_total_bytes", "predicted_total_bytes", "max_fitting",
                                                   "fit_check_error"}


def test_where_this_machine_cannot_hold_the_limit_the_line_says_how_far_it_extrapolated(fit_children_here, tmp_path, monkeypatch):
    from benchlib.measure import isolation

    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB / 4}))
    monkeypatch.setattr(isolation, "available_memory", lambda device: 150 * MB)  # below the 200.6 MB asked
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 progress=lambda line: None)
    (torch_fit,) = result.engines
    # no point toward an answer it could not confirm, and no confirmation
    assert [value for value, _, _ in torch_fit.points] == [8, 16, 32, 64] and torch_fit.max_fitting == 402
    assert all(not fit.checked and fit.confirmed is None for fit in result.engines)
    assert "predicted, extrapolated 6.28x past the largest measured value (64)" in result.lines()[0]
    assert "not measured nearer the answer: the limit is above the 150.0 MB cpu has available" in result.lines()[1]


def test_the_answer_is_read_from_the_size_models_upper_bound_and_keeps_the_margin(fit_children_here, tmp_path, monkeypatch):
    noisy = {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.1}  # the largest point 10% above the line through the others
    monkeypatch.setattr(measured, "measure_step", lambda _file, _engine, values, _device, **_options: StepOutcome(
        int((100 * MB + values["n"] * MB) * noisy.get(values["n"], 1.0)), 1e-3))
    result = fit(model_file(tmp_path), memory="300 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=NO_VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    error = torch_fit.model.check_error
    assert error > 0.05
    assert torch_fit.model(torch_fit.max_fitting) * (1 + error) <= 300 * MB
    assert torch_fit.model(torch_fit.max_fitting + 1) * (1 + error) > 300 * MB
    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB}))
    kept = fit(model_file(tmp_path), memory=MemoryLimit("300 MB", 0.1), scale="n", engines=["torch"],
               params={"n": 64}, search=NO_VERIFY, progress=lambda line: None)
    answer = kept.engines[0].max_fitting  # 10% of 300 MB kept free: at most 100 MB + 170 MB, and not timid
    assert 100 * MB + answer * MB <= 270 * MB < 100 * MB + (answer + 2) * MB
    assert "under 300.0 MB less a 10% margin (270.0 MB)" in kept.lines()[0]
    assert {json.loads(row["params"])["margin"] for row in kept.records() if row["metric"] == "max_fitting"} == {0.1}


@pytest.mark.slow  # its run directory's environment asks git
def test_the_answer_is_confirmed_by_measurement_by_default_and_no_verify_skips_it(fit_children_here, tmp_path, monkeypatch, capsys):
    asked = []

    def measure(_file, engine, values, _device, **_options):
        asked.append(values["n"])
        return StepOutcome(int(100 * MB + values["n"] * MB), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    path = str(model_file(tmp_path))
    assert main(["fit", path, "--memory", "150 MB", "--scale", "n", "--engines", "torch", "-p", "n=32",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "is 50, with torch" in out and "confirmed: measured in fresh processes, under the limit there and over it at 51" in out
    assert 50 in asked and 51 in asked  # the answer, and one past it over the limit
    asked.clear()
    assert main(["fit", path, "--memory", "150 MB", "--scale", "n", "--engines", "torch", "-p", "n=32",
                 "--no-verify", "--out", str(tmp_path / "out2")]) == 0
    assert asked == [4, 8, 16, 32] and "predicted, extrapolated 1.56x" in capsys.readouterr().out
    asked.clear()
    assert main(["fit", path, "--memory", "150 MB", "--scale", "n", "--engines", "torch", "-p", "n=32",
                 "--quick", "--out", str(tmp_path / "out3")]) == 0
    out = capsys.readouterr().out
    assert asked[:3] == [8, 16, 32] and 50 in asked and "confirmed: measured in fresh processes" in out
    assert "quick search: 3 points, 1 measured step(s) per process, answers held in 1 process(es), to 10%" in out


def test_the_quick_search_measures_fewer_points_steps_and_holds_and_still_confirms(fit_children_here, tmp_path, monkeypatch):
    from benchlib.fit import QUICK, THOROUGH

    def searched(search):
        asked = []

        def measure(_file, _engine, values, _device, steps, **_options):
            asked.append((values["n"], steps))
            return StepOutcome(int(100 * MB + values["n"] * MB * (1 + 0.0005 * len(asked))), values["n"] * 1e-3)

        monkeypatch.setattr(measured, "measure_step", measure)
        result = fit(model_file(tmp_path), memory="150 MB", scale="n", engines=["torch"], params={"n": 32},
                     progress=lambda line: None, search=search)
        return result.engines[0], asked

    thorough, thorough_asked = searched(THOROUGH)
    quick, quick_asked = searched(QUICK)
    assert [value for value, _ in thorough_asked[:4]] == [4, 8, 16, 32]
    assert [value for value, _ in quick_asked[:3]] == [8, 16, 32]
    assert {steps for _, steps in thorough_asked} == {3} and {steps for _, steps in quick_asked} == {1}
    assert len(quick_asked) < len(thorough_asked)
    for engine_fit in (thorough, quick):  # both confirmed by measurement, under the limit
        assert engine_fit.confirmed is not None and engine_fit.checked[engine_fit.confirmed] <= 150 * MB
    with pytest.raises(ValueError, match="hold_repeats must be an integer >= 1"):
        dataclasses.replace(QUICK, hold_repeats=0)
    with pytest.raises(ValueError, match="fractions must be shares"):
        dataclasses.replace(QUICK, fractions=(0.5, 2))


@pytest.mark.parametrize("argv, message", [
    (["--memory", "1 GB", "--scale", "n", "--margin", "lots"], "--margin 'lots': a share of the limit"),
    (["--memory", "1 GB", "--scale", "n", "--margin", "100%"], "--margin 1: a share of the limit kept free"),
    (["--memory", "lots", "--scale", "n"], "not a memory size"),
    (["--memory", "0", "--scale", "n"], "--memory 0: nothing fits in no memory"),
    (["--memory", "1 GB", "--scale", "batch"], "'batch' is not a parameter of tiny.py; its parameters: width, n"),
    (["--memory", "1 GB", "--scale", "n", "--engines", "torch,jax"], "--engines: 'jax' is no technique; valid: torch"),
    (["--memory", "1 GB", "--scale", "n", "-p", "n=2"], "only 2 distinct values"),
    (["--memory", "1 GB", "--scale", "n", "--out", "/dev/null/runs"], "cannot be created: '/dev/null' is a file"),
    (["--memory", "1 GB", "--scale", "n", "-p", "trials=3"], "-p trials: is a setting of `benchlib run`'s trials"),
    (["--memory", "1 GB", "--scale", "n", "--engines", ""], "--engines names no engine"),
    (["--memory", "1 GB", "--scale", "n", "--engines", "torch,,torch"], "'torch,,torch' has an empty name"),
])
def test_bad_input_is_refused_with_exit_2_before_anything_is_measured(fit_children_here, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(measured, "measure_step", None)  # any measurement would raise
    assert main(["fit", str(model_file(tmp_path)), "--out", str(tmp_path / "out"), *argv]) == 2  # a later --out wins
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # its run directory's environment asks git
def test_exit_0_when_an_engine_fits_and_1_when_none_fits_at_the_smallest_value(fit_children_here, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB}))
    path = str(model_file(tmp_path))
    assert main(["fit", path, "--memory", "150 MB", "--scale", "n", "--engines", "torch", "-p", "n=16",
                 "--out", str(tmp_path / "out")]) == 0
    (run,) = (tmp_path / "out").iterdir()
    assert set(load_records(run)["metric"]) >= {"fit_total_bytes", "max_fitting"}
    assert load_run_info(run)["notebooks"]["tiny_fit"]["benchmarks"] == ["tiny"]
    page = (run / "report.html").read_text()
    assert "the largest n under 150.0 MB" in page and "data-name='tiny_fit'" in page
    assert load_run_info(run)["notebooks"]["tiny_fit"]["status"] == "ok"
    assert main(["fit", path, "--memory", "50 MB", "--scale", "n", "--engines", "torch", "-p", "n=16",
                 "--out", str(tmp_path / "out2")]) == 1
    assert "no engine fits 50.00 MB" in capsys.readouterr().out
    (run,) = (tmp_path / "out2").iterdir()  # exit 1 is listed as failed, the answer its reason
    entry = load_run_info(run)["notebooks"]["tiny_fit"]
    assert entry["status"] == "failed" and "no engine fits 50.00 MB" in entry["error"]
    assert list_runs(tmp_path / "out2")["failed"].tolist() == [1]


@pytest.mark.slow
def test_a_real_fit_predicts_the_measured_total_at_twice_the_largest_point(tmp_path):
    path = tmp_path / "wide.py"
    path.write_text(textwrap.dedent(GOOD).replace('"width": 16, "n": 8', '"width": 1024, "n": 16384'))
    result = fit(path, memory="100 GB", scale="n", engines=["torch"], params={"n": 16384}, progress=lambda line: None)
    (torch_fit,) = result.engines
    total = measured.measure_step(read_model_file(path), "torch", {"width": 1024, "n": 32768}, fitting_device()).total
    assert math.isfinite(torch_fit.model.check_error)
    assert abs(torch_fit.model(32768) - total) / total < 0.10


def fitting_device():
    from benchlib.measure import resolve_device

    return resolve_device("cpu")


def test_the_trace_model_is_the_traced_curve_mapped_onto_the_measured_totals_and_is_checked():
    traced = []

    def trace(value):
        traced.append(value)
        return 1000 * value + 50

    points = [(2, 12_050 + 2_000), (4, 14_050 + 2_000), (8, 18_050 + 2_000)]  # measured = traced + 12_000
    model, peaks = trace_model(points, trace)
    assert model.kind == TRACE and model.check_error == pytest.approx(0, abs=1e-9)
    assert model(1000) == pytest.approx(1_012_050)
    assert sorted(traced) == [2, 4, 8, 16, 32, 64] and peaks[64] == 64_050  # the measured values, then 2x, 4x, 8x
    quadratic, _ = trace_model(points, lambda value: value * value)  # the allocator's bytes per tensor byte
    scale, offset = np.polyfit([4, 16, 64], [14_050, 16_050, 20_050], 1)  # and the constant, by least squares
    assert quadratic(100) == pytest.approx(scale * 10_000 + offset)
    grown, _ = trace_model([(2, 1_000 + 2_000), (4, 1_000 + 4_000), (8, 1_000 + 8_000)], lambda value: 800 * value)
    assert grown.check_error == pytest.approx(0) and grown(100) == pytest.approx(1_000 + 100_000)
    off, _ = trace_model([(2, 100), (4, 200), (8, 900)], lambda value: 0)
    assert off.check_error == pytest.approx(750 / 900)  # the constant of the smaller points misses the largest


OWN_ACTIVATIONS = """
import torch

PARAMETERS = {"n": 8}

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))

def model(n):
    return torch.nn.Sequential(Block(), Block())

def batch(n):
    return (torch.randn(n, 16),)

def loss(model, x):
    return model(x).square().mean()

def optimizer(parameters):
    return torch.optim.Adam(parameters, lr=1e-3)
"""


def blocks_file(tmp_path):
    """OWN_ACTIVATIONS, written and read: a model file of two blocks whose activations grow with n."""
    path = tmp_path / "blocks.py"
    path.write_text(OWN_ACTIVATIONS)
    return read_model_file(path)


@pytest.mark.parametrize("engine", ["torch", "torch-checkpoint", "fused-optimizer"])
def test_a_fake_tensor_trace_counts_the_bytes_a_real_step_holds_at_its_peak(tmp_path, engine):
    # the same tracker over real tensors: the trace under fake tensors must hold the same bytes, taking none
    file = blocks_file(tmp_path)
    for n in (4, 32):
        real = tracked_peak(file, engine, {"n": n})
        parameters = sum(p.numel() * p.element_size() for p in file.build({"n": n})[0].parameters())
        assert real >= 3 * parameters  # parameters and Adam's two moments at least, gradients besides
        assert traced_peak(file, engine, {"n": n}) == real
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    huge = traced_peak(file, engine, {"n": 50_000_000})  # 3.2 GB of batch alone: traced, never held
    assert huge > 10 * 2**30 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < 2**30


def test_a_step_torch_cannot_trace_keeps_the_measured_model_and_says_why(fit_children_here, tmp_path, monkeypatch):
    path = tmp_path / "held.py"  # the batch, a slice of a tensor made at import: real, where the trace is fake
    path.write_text(OWN_ACTIVATIONS.replace("def batch(n):", "DATA = torch.randn(4096, 16)\n\ndef batch(n):")
                    .replace("return (torch.randn(n, 16),)", "return (DATA[:n],)"))
    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB}))
    (engine_fit,) = fit(path, memory="1 GB", scale="n", engines=["torch"], params={"n": 64},
                        progress=lambda line: None).engines
    assert engine_fit.model.kind == LINEAR and engine_fit.untraced and not engine_fit.traced
    assert "not traced: " + engine_fit.untraced in "\n".join(fit(path, memory="1 GB", scale="n", engines=["torch"],
                                                                   params={"n": 64}, progress=lambda line: None).lines())


def linear_fit(**fields):
    """An engine measured at 1, 2 and 4, 1000 bytes per unit, whose linear size model says so exactly."""
    return EngineFit("torch", points=[(1, 1000, 0.0), (2, 2000, 0.0), (4, 4000, 0.0)],
                     model=SizeModel(LINEAR, (1000.0, 0.0), 0.0), **fields)


def test_verify_finds_the_true_largest_value_by_measurement_from_either_side_of_the_prediction():
    probed, failing = [], set()

    def measure(value):
        probed.append(value)
        return StepOutcome(1000 * value, 0.0) if value not in failing else StepOutcome(reason="failed: on purpose")

    def search(predicted, limit=10_500, affordable=1e12):
        best = linear_fit(checked={predicted: 1000 * predicted})
        largest = measured.largest_measured(measure, best, "n", limit, affordable, lambda line: None)
        return None if largest is None else (largest, dict(sorted(best.checked.items())))

    assert search(7)[0] == 10
    assert probed == [8, 9, 10, 11]  # up along the line, never more than 1.2x past a value under the limit
    probed.clear()
    assert search(13) == (10, {10: 10_000, 11: 11_000, 13: 13_000})  # down, from the fit's points under the limit
    assert probed == [10, 11]  # where the line through the totals crosses the limit, then one past it
    probed.clear()
    assert search(100, limit=1_000_500)[0] == 1000
    # two totals close together draw a line that can cross far away: noise on the CPU made one such step ask twice
    # the answer, so each step up is at most 1.2x, and a prediction 10x under costs a dozen processes, not hundreds
    assert all(after <= 1.2 * before + 1 for before, after in zip([100, *probed], probed)) and len(probed) <= 16
    failing.add(10)
    assert search(7) is None  # a measurement that fails stops the search
    assert search(7, affordable=8500) is None  # the next value would not fit this machine


def test_verify_bisects_where_the_totals_are_not_a_line():
    probed = []

    def measure(value):  # a step at 12: the allocator takes a new segment
        probed.append(value)
        return StepOutcome(1000 * value + (5000 if value >= 12 else 0), 0.0)

    best = linear_fit(checked={8: 8000})
    largest = measured.largest_measured(measure, best, "n", 14_000, 1e12, lambda line: None)
    assert largest == 11 and best.checked[11] <= 14_000 < best.checked[12]
    assert len(probed) <= 5


def test_totals_that_do_not_grow_are_searched_between_the_last_value_under_and_the_first_over():
    """A step whose total barely moves with the value (a model's weights dwarf its batch) still has a first value
    over the limit: the answer lies between it and the last one under, so it is bisected there (no line: the
    totals' slope is noise), never left at a value far below the limit."""
    probed = []

    def measure(value):
        probed.append(value)
        return StepOutcome(490_000_000 + 150_000 * value, 0.0)

    flat = EngineFit("torch", points=[(2, 490_300_000, 0.0), (4, 490_600_000, 0.0), (8, 491_200_000, 0.0)],
                     model=SizeModel(LINEAR, (150_000.0, 490_000_000.0), 0.0), flat="its total does not grow",
                     checked={4: 490_600_000, 8: 491_200_000})
    largest = measured.largest_measured(measure, flat, "batch_size", 491_100_000, 1e12, lambda line: None)
    assert largest == 7 and probed == [6, 7]
    unbracketed = EngineFit("torch", points=flat.points[:2], model=flat.model, flat=flat.flat)
    assert measured.largest_measured(measure, unbracketed, "batch_size", 500e6, 1e12, lambda line: None) is None
    assert probed == [6, 7]  # nothing measured past the values, where no line says how far to go


def test_fit_measures_under_the_allocator_a_training_process_has_not_the_one_run_compares_peaks_under(tmp_path):
    # glibc keeps freed heap: a small ViT's step read 900 MB under run's fixed mmap threshold where a lean process
    # of its own reached 1077 MB, so answers overshot the limit
    import benchlib.measure
    from benchlib.measure import resolve_device
    from benchlib.measure.isolation import DEFAULT_MALLOC_POLICY

    seen = []

    def run_isolated(*args, options, **kwargs):
        seen.append(options.malloc)
        raise benchlib.measure.CaseNotApplicable("tiny/torch", "stop here")

    outcome = measured.measure_step(read_model_file(model_file(tmp_path)), "torch", {"width": 4, "n": 3},
                                    resolve_device("cpu"), isolate=run_isolated)
    assert outcome == StepOutcome(reason="not applicable: stop here")
    assert seen == ["training-process"] and DEFAULT_MALLOC_POLICY != "training-process"


@pytest.mark.slow  # the file is read in its child, which measures what a process holds with torch imported
@pytest.mark.parametrize("question", [["--scale", "n"], ["--at", "n=8"]])
def test_a_limit_below_what_an_interpreter_with_torch_holds_is_refused_before_any_step(question, tmp_path, monkeypatch,
                                                                                      capsys):
    stepped = []
    monkeypatch.setattr(measured, "measure_step", lambda *args, **kwargs: stepped.append(args))
    assert main(["fit", str(model_file(tmp_path)), "--memory", "1", *question, "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert said.startswith("benchlib: error: --memory 1 byte: on the CPU a step's total is its process's resident "
                           "memory, and a process holds ") and "once it has imported torch" in said
    assert stepped == [] and not (tmp_path / "out").exists()


FIT_IMPORTS = """
import json, sys
from benchlib.fit import measured
from benchlib.fit.measured import StepOutcome
from benchlib.runner.cli import main

imported = []

def measure(_file, _engine, values, _device, **_options):
    imported.extend(imported or sorted(sys.modules))
    return StepOutcome(int(500e6 + values["n"] * 1e6), 1e-3)

measured.measure_step = measure
code = main(["fit", sys.argv[1], "--memory", "550MB", "--scale", "n", "--engines", "torch", "--no-verify",
             "--out", sys.argv[2]])
print(json.dumps({"code": code, "imported": imported}))
"""


@pytest.mark.slow  # a fresh interpreter: this one has imported the notebook runner for other tests
def test_fit_imports_nothing_of_the_notebook_runner_nor_the_report_before_it_measures(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FIT_IMPORTS, str(model_file(tmp_path)), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["code"] == 0 and said["imported"], done.stderr[-2000:]
    runner = [name for name in said["imported"] if name.split(".")[0] in ("jupyter_client", "zmq", "tornado",
                                                                         "traitlets", "papermill", "nbformat")
              or name in ("benchlib.runner.kernels", "benchlib.runner.papermill_exec", "benchlib.runner.preflight",
                          "benchlib.runner.notebooks", "benchlib.runner.execute", "benchlib.usermodel.declare")]
    assert runner == []
    shown = [name for name in said["imported"] if name.startswith("benchlib.report") or name.split(".")[0] == "plotly"]
    assert shown == []  # the question is asked with the file's parameters alone (`usermodel.parameters`)


def test_a_measured_step_runs_no_check_unless_its_memory_by_module_is_asked_for(tmp_path):
    import benchlib.measure
    from benchlib.measure import resolve_device

    asked = []

    def run_isolated(_target, params, **_kwargs):
        asked.append(params)
        raise benchlib.measure.CaseNotApplicable("tiny/torch", "stop here")

    file = read_model_file(model_file(tmp_path))
    measured.measure_step(file, "torch", {"width": 4, "n": 3}, resolve_device("cpu"), isolate=run_isolated)
    measured.measure_step(file, "torch", {"width": 4, "n": 3}, resolve_device("cpu"), by_module=[],
                          isolate=run_isolated)
    assert asked[0]["check"] == "none"  # the check's gradients and roles would be thrown away
    assert "check" not in asked[1] and asked[1]["module_depth"] == measured.DEEP  # memory by module is the check's



@pytest.mark.slow  # its run directory's environment asks git
def test_at_the_batch_you_have_the_engines_that_fit_are_ranked_fastest_first(fit_children_here, tmp_path, monkeypatch, capsys):
    joined = "torch-checkpoint+torch-autocast"  # as named below, in the other order: measured under this name
    per_step = {"torch": 2e-3, "torch-checkpoint": 3e-3, joined: 1e-3}
    totals = {"torch": lambda n: 100 * MB + n * MB, "torch-checkpoint": lambda n: 100 * MB + n * MB / 4,
              joined: lambda n: 100 * MB + n * MB / 8}
    monkeypatch.setattr(measured, "measure_step", lambda _file, engine, values, _device, **_options: StepOutcome(
        int(totals[engine](values["n"])), per_step[engine]))
    path = str(model_file(tmp_path))
    engines = "torch,torch-checkpoint,torch-autocast+torch-checkpoint"
    assert main(["fit", path, "--memory", "120 MB", "--at", "n=32", "--engines", engines,
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out.splitlines()
    out = printed[next(index for index, line in enumerate(printed) if line.startswith("tiny at n=32:")):]
    assert out[0].startswith("tiny at n=32: 2 of 3 engines fit under 120.0 MB")
    assert [line.split()[0] for line in out[1:4]] == ["torch-checkpoint+torch-autocast", "torch-checkpoint", "torch"]
    assert "does not fit: 132.0 MB measured" in out[3]
    (run,) = (tmp_path / "out").iterdir()
    assert set(load_records(run)["metric"]) >= {"fit_total_bytes", "time"}
    assert main(["fit", path, "--memory", "100 MB", "--at", "n=32", "--engines", engines,
                 "--out", str(tmp_path / "out2")]) == 1
    assert "no engine fits under 100.0 MB" in capsys.readouterr().out


def test_at_a_limit_this_machine_cannot_hold_the_totals_are_predicted_with_their_interval(fit_children_here, tmp_path, monkeypatch):
    from benchlib.measure import isolation
    from benchlib.fit.at import fit_at

    from benchlib.usermodel import reading

    monkeypatch.setattr(measured, "measure_step", fake_measure({"torch": lambda n: 100 * MB + n * MB}))
    monkeypatch.setattr(isolation, "available_memory", lambda device: 50 * 10 ** 9)
    reads, read_here = [], reading.read_in_child
    monkeypatch.setattr(reading, "read_in_child", lambda *args, **kwargs: reads.append(args) or read_here(*args, **kwargs))
    result = fit_at(model_file(tmp_path), memory="80 GB", at="n=64", engines=["torch"], progress=lambda line: None)
    assert len(reads) == 1  # the question asked once, and the size model's search fits that question
    (torch_at,) = result.engines
    assert torch_at.basis.startswith("predicted (size model") and torch_at.low <= torch_at.total <= torch_at.high
    assert torch_at.total == pytest.approx(164 * MB, rel=1e-6) and result.fitting == [torch_at]


@pytest.mark.parametrize("argv, message", [
    (["--memory", "1 GB", "--at", "n"], "--at 'n': a parameter and its value, as batch_size=64"),
    (["--memory", "1 GB", "--at", "n=8", "--scale", "n"], "give --scale PARAM"),
    (["--memory", "1 GB"], "give --scale PARAM"),
    (["--memory", "1 GB", "--at", "width=x"], "--at 'width=x': 'x' is not an integer; the value of width to answer at"),
    (["--memory", "1 GB", "--at", "n=0"], "--at 'n=0': the value of n must be at least 1"),
    (["--memory", "1 GB", "--at", "nope=3"], "--at 'nope' is not a parameter of tiny.py; its parameters: width, n"),
    (["--memory", "1 GB", "--at", "n=8", "-p", "n=16"], "--at n=8 and -p n=16 both set n; give one"),
])
def test_at_refuses_what_it_cannot_answer_before_anything_is_measured(fit_children_here, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(measured, "measure_step", None)
    assert main(["fit", str(model_file(tmp_path)), "--out", str(tmp_path / "out"), *argv]) == 2  # a later --out wins
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_two_answers_the_largest_value_and_the_fastest_engine_at_the_largest_value_all_reach(fit_children_here, tmp_path, monkeypatch):
    def measure(_file, engine, values, _device, **_options):  # checkpointing: a quarter of the memory per sample, 3x the time
        per_sample = {"torch": (MB, 1e-3), "torch-checkpoint": (MB / 4, 3e-3)}[engine]
        return StepOutcome(int(100 * MB + values["n"] * per_sample[0]), values["n"] * per_sample[1])

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch", "torch-checkpoint"],
                 params={"n": 64}, search=NO_VERIFY, progress=lambda line: None)
    assert result.best.engine == "torch-checkpoint" and result.best.largest == 402
    assert result.common_value == 100 and result.fastest.engine == "torch"
    largest, fastest = result.answers()
    assert "the largest n under 200.6 MB" in largest and "is 402, with torch-checkpoint" in largest
    assert ("the fastest at n=100, the largest every fitting engine reaches, is torch (1.000 ms per sample at n=64, "
            "the largest value all were timed at)") in fastest
    rows = {row["engine"]: row for row in result.rows()}
    assert rows["torch-checkpoint"]["answer"] == largest and rows["torch"]["answer"] == fastest
    assert rows["torch"]["largest"] == 100 and rows["torch"]["seconds_per_sample"] == pytest.approx(1e-3)
    low, high = rows["torch"]["total_low"], rows["torch"]["total_high"]
    assert low <= rows["torch"]["total_bytes"] <= high


def test_confirmation_measures_the_fastest_engine_at_the_common_value_too(fit_children_here, tmp_path, monkeypatch):
    asked = []

    def measure(_file, engine, values, _device, **_options):
        asked.append((engine, values["n"]))
        per_sample = {"torch": (MB, 1e-3), "torch-checkpoint": (MB / 4, 3e-3)}[engine]
        return StepOutcome(int(100 * MB + values["n"] * per_sample[0]), values["n"] * per_sample[1])

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch", "torch-checkpoint"],
                 params={"n": 64}, search=VERIFY, progress=lambda line: None)
    assert result.best.confirmed == 402 and ("torch-checkpoint", 403) in asked  # one past it, over the limit
    assert result.fastest.engine == "torch" and ("torch", 100) in asked  # the common value, measured
    records = result.records()
    confirming = [row for row in records if row["metric"] == "fit_total_bytes" and '"confirms": true' in row["params"]]
    assert {(row["variant"], json.loads(row["params"])["value"]) for row in confirming} >= {("torch", 100),
                                                                                          ("torch-checkpoint", 403)}


def test_added_combinations_are_predicted_from_their_traces_and_measured_only_past_every_engine(fit_children_here, tmp_path, monkeypatch):
    from benchlib.fit import in_child

    per_byte = {"torch": 1.0, "torch-checkpoint+torch-autocast": 0.25, "torch-sac+torch-autocast": 2.0}

    def traces(_file, engine, values, scale, at):  # the combinations' steps, as if traced: bytes per sample by engine
        if engine not in per_byte:
            return {}, "NotImplementedError: not traceable here"
        return {value: int(value * MB * per_byte[engine]) for value in at}, None

    def measure(_file, engine, values, _device, **_options):
        return StepOutcome(int(100 * MB + values["n"] * MB * per_byte[engine]), values["n"] * 1e-3)

    monkeypatch.setattr(in_child, "traced_peaks", traces)
    monkeypatch.setattr(measured, "measure_step", measure)
    lines = []
    result = fit(model_file(tmp_path), memory="300 MB", scale="n", engines=None,
                 params={"n": 64, "engines": "torch"}, search=NO_VERIFY, progress=lines.append)
    fits = {engine_fit.engine: engine_fit for engine_fit in result.engines}
    assert fits["torch"].max_fitting == 200
    beyond = fits["torch-checkpoint+torch-autocast"]  # predicted 800 > 200: on the frontier, so measured
    assert beyond.points and beyond.max_fitting == 800 and result.best is beyond
    short = fits["torch-sac+torch-autocast"]  # predicted 100: not measured, its answer a prediction
    assert not short.points and short.max_fitting == 100 and "not measured" in short.unmeasured
    untraced = [fit for name, fit in fits.items() if name not in per_byte]
    assert untraced and all(fit.reason.startswith("not predicted: its step cannot be traced") and not fit.points
                            for fit in untraced)
    assert any("past every measured engine (200): measured" in line for line in lines)
    # a trace's process says it starts, with its limit, before the silence of its run (minutes on a large step)
    announced = [i for i, line in enumerate(lines) if " torch: tracing at n=" in line]
    assert announced and all("under fake tensors, in one process (at most 600 s)" in lines[i] and
                             " torch: traced at " in lines[i + 1] for i in announced)


def test_an_engine_that_splits_the_batch_is_asked_only_multiples_of_its_split(fit_children_here, tmp_path, monkeypatch):
    asked = []

    def measure(_file, engine, values, _device, **_options):  # micro-batches refuse a batch that does not split in four
        asked.append(values["n"])
        if values["n"] % 4:
            return StepOutcome(reason="not applicable: the batch does not split into 4 equal micro-batches")
        return StepOutcome(int(100 * MB + values["n"] * MB / 4), values["n"] * 1e-3)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch-microbatch"], params={"n": 64},
                 search=VERIFY, progress=lambda line: None)
    (microbatch,) = result.engines
    assert microbatch.multiple == 4 and microbatch.max_fitting % 4 == 0
    assert all(value % 4 == 0 for value in asked) and microbatch.confirmed == 400  # 402 is no multiple of 4


def test_every_engine_is_confirmed_at_its_own_answer_and_searched_where_it_is_over(fit_children_here, tmp_path, monkeypatch):
    def measure(_file, engine, values, _device, **_options):  # checkpointing's total grows faster past its points than they show
        n = values["n"]
        total = 100 * MB + n * MB if engine == "torch" else 100 * MB + n * MB / 4 + max(0, n - 252) ** 2 * MB / 400
        return StepOutcome(int(total), 1e-3 * n)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch", "torch-checkpoint"],
                 params={"n": 64}, search=VERIFY, progress=lambda line: None)
    fits = {engine_fit.engine: engine_fit for engine_fit in result.engines}
    checkpoint = fits["torch-checkpoint"]  # predicted 402 from a line; measured over there, so searched down
    assert checkpoint.max_fitting == 402 and checkpoint.checked[402] > 200.6 * MB
    assert checkpoint.confirmed < 402 and checkpoint.checked[checkpoint.confirmed] <= 200.6 * MB
    assert 100 in fits["torch"].checked and fits["torch"].checked[100] <= 200.6 * MB  # its own answer, measured
    assert result.best is checkpoint and result.best.largest == checkpoint.confirmed


def test_an_answer_is_measured_three_times_and_one_process_over_the_limit_takes_it_back(fit_children_here, tmp_path, monkeypatch):
    seen = {}

    def measure(_file, engine, values, _device, **_options):  # every second process at a value reads 3% more (another arena)
        n = values["n"]
        seen[n] = seen.get(n, 0) + 1
        return StepOutcome(int((100 * MB + n * MB) * (1.03 if seen[n] == 2 else 1.0)), 1e-3 * n)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="200.6 MB", scale="n", engines=["torch"], params={"n": 64},
                 search=VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert torch_fit.confirmed is not None and torch_fit.confirmed < 100  # 100 read 206 MB in its second process
    assert seen[torch_fit.confirmed] >= 3 and torch_fit.checked[torch_fit.confirmed] <= 200.6 * MB


def test_an_answer_far_under_the_limit_is_searched_up_so_it_is_not_timid(fit_children_here, tmp_path, monkeypatch):
    noisy = {8: 1.0, 16: 1.0, 32: 1.0, 64: 1.3}  # a wide out-of-sample error: the upper bound answers far short

    def measure(_file, engine, values, _device, **_options):
        n = values["n"]
        total = (100 * MB + n * MB) * (noisy.get(n, 1.0) if engine == "torch-checkpoint" else 1.0)
        return StepOutcome(int(total if engine == "torch-checkpoint" else 100 * MB + n * MB / 8), 1e-3 * n)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="300 MB", scale="n", engines=["torch", "torch-checkpoint"],
                 params={"n": 64}, search=VERIFY, progress=lambda line: None)
    checkpoint = {engine_fit.engine: engine_fit for engine_fit in result.engines}["torch-checkpoint"]
    assert checkpoint.max_fitting < 180 and checkpoint.confirmed >= 196  # 100 MB + n MB under 300 MB: 200 at most


def test_a_confirmed_value_whose_memory_was_mispredicted_says_so_and_never_calls_the_prediction_exact(
        fit_children_here, tmp_path, monkeypatch):
    def measure(_file, engine, values, _device, **_options):  # a line up to 32; past it a tenth as steep, then a jump
        n = values["n"]
        extra = n * MB if n <= 32 else 32 * MB + (n - 32) * MB / 10 if n <= 50 else 200 * MB
        return StepOutcome(int(100 * MB + extra), 1e-3 * n)

    monkeypatch.setattr(measured, "measure_step", measure)
    result = fit(model_file(tmp_path), memory="150 MB", scale="n", engines=["torch"], params={"n": 32},
                 search=VERIFY, progress=lambda line: None)
    (torch_fit,) = result.engines
    assert torch_fit.max_fitting == torch_fit.confirmed == 50  # the predicted value held...
    text = "\n".join(result.lines())
    error = re.search(r"confirming torch at n=50: predicted .*, measured .* \(error (\+[0-9.]+)%\)", text).group(1)
    assert float(error) >= 5  # ...but its bytes were predicted well over what was measured there
    assert f"the predicted value held, though its memory there was predicted {error}% off" in text
    assert "exact" not in text  # before: "the prediction was exact"


def test_fit_at_never_headlines_no_engine_fits_when_no_engine_had_an_answer():
    from benchlib.fit.at import AtEngine, AtResult

    reason = "not applicable: the file declares no optimizer(parameters)"
    result = AtResult("cnn", "batch_size", 8, 2 * 10**9, 0.0, "cpu", "resident",
                      [AtEngine("fused-optimizer", reason=reason)])
    # before: "no engine fits under 2.000 GB", as if the engine had been measured over it
    assert result.lines()[0] == "cnn at batch_size=8: no engine could be measured or predicted; each says why"
    assert reason in result.lines()[1]
    result.engines.append(AtEngine("torch", total=3e9))
    assert "no engine fits under 2.000 GB" in result.lines()[0]


def test_a_time_per_unit_names_what_the_scaled_parameter_counts():
    """Seconds per sample only where the batch grows with the parameter; a sequence length's unit is a position."""
    from types import SimpleNamespace

    from benchlib.fit.largest import unit_of

    read = SimpleNamespace(batch_parameters=("batch_size",))
    assert unit_of(read, "batch_size") == "sample" and unit_of(read, "seq_len") == "unit of seq_len"
    unread = SimpleNamespace(batch_parameters=None)  # the reading child could not tell
    assert unit_of(unread, "batch") == "sample" and unit_of(unread, "width") == "unit of width"
