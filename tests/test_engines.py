"""The engine interface: registry, namespaces, gradient conventions, comparison bookkeeping."""

import json
import math
import os
import tempfile

import numpy as np
import pandas as pd
import pytest
import torch

import benchlib.measure
from benchlib.analysis.engine_summary import Problem
from benchlib.report.tables.engine_summary import comparison_text
from benchlib.engines import ENGINE_NAMES, ENGINES, NotApplicableError, get_engine
from benchlib.engines import namespaces
from benchlib.trials.cases import (
    Cases,
    EngineComparison,
    GradientMismatch,
    compare_engines,
    planned_engines,
    summarize,
    validate_common,
)
from benchlib.trials import trial_order
from benchlib.engines.gradients import (
    GRADIENT_TOLERANCE,
    gradient_tolerance,
    load_gradient,
    max_relative_error,
    save_gradient,
    saved_gradient_error,
)
from benchlib.measure import Device
from benchlib.records import make_record, records_frame

CPU = Device("cpu")
CUDA = Device("cuda", 0)
AUTOMATIC = [name for name in ENGINE_NAMES if not get_engine(name).hand_written]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_registry_holds_the_eleven_engines_and_refuses_unknown_names():
    assert ENGINE_NAMES == ("manual", "manual-seed", "benchlib-inplace", "benchlib-deferred", "benchlib-checkpoint",
                            "autograd", "torch", "torch-checkpoint", "torch-sac", "torch-autocast", "torch.compile")
    assert all(ENGINES[name].name == name for name in ENGINE_NAMES)
    with pytest.raises(ValueError, match="valid engines: manual, manual-seed, benchlib-inplace"):
        get_engine("jax")


def test_autograd_is_not_applicable_on_cuda_and_says_why():
    assert get_engine("autograd").not_applicable(CUDA) == "HIPS autograd computes with NumPy, on the CPU only (asked for cuda:0)"
    for name in ENGINE_NAMES:
        assert get_engine(name).not_applicable(CPU) is None
        if name != "autograd":
            assert get_engine(name).not_applicable(CUDA) is None
    with pytest.raises(NotApplicableError, match="CPU only"):
        get_engine("autograd").namespace(CUDA)


def test_array_library_per_engine_and_device():
    assert {name: get_engine(name).array_library(CPU) for name in ENGINE_NAMES} == {
        "manual": "numpy", "manual-seed": "numpy", "benchlib-inplace": "numpy", "benchlib-deferred": "numpy",
        "benchlib-checkpoint": "numpy", "autograd": "numpy", "torch": "torch", "torch-checkpoint": "torch",
        "torch-sac": "torch", "torch-autocast": "torch", "torch.compile": "torch"}
    assert {name: get_engine(name).array_library(CUDA) for name in ENGINE_NAMES if name != "autograd"} == {
        "manual": "torch", "manual-seed": "torch", "benchlib-inplace": "torch", "benchlib-deferred": "torch", "benchlib-checkpoint": "torch",
        "torch": "torch", "torch-checkpoint": "torch", "torch-sac": "torch", "torch-autocast": "torch",
        "torch.compile": "torch"}


def test_asarray_keeps_numpy_arrays_and_shares_storage_with_torch_on_cpu():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert get_engine("manual").asarray(array, CPU) is array
    tensor = get_engine("torch").asarray(array, CPU)
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
    assert tensor.data_ptr() == array.ctypes.data
    np.testing.assert_array_equal(get_engine("torch").to_numpy(tensor), array)


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_asarray_keeps_the_shape_of_a_scalar_and_of_a_strided_view(name):
    engine = get_engine(name)
    scalar = engine.asarray(np.array(2.5), CPU)
    assert tuple(scalar.shape) == () and float(scalar) == 2.5
    view = np.arange(12.0).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(engine.to_numpy(engine.asarray(view, CPU)), view)


def _reference_gradients(x, z):
    """d/dx and d/dz of sum(tanh(x·z) * 2 + relu(x·z)), by hand."""
    product = x @ z
    outer = 2 * (1 - np.tanh(product) ** 2) + (product > 0)
    return outer @ z.T, x.T @ outer


def _loss(xp):
    def loss(x, z):
        product = xp.dot(x, z)
        return xp.sum(xp.tanh(product) * 2 + xp.relu(product))

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", AUTOMATIC)
def test_every_engine_differentiates_one_loss_written_against_its_namespace(name, dtype):
    engine = get_engine(name)
    rng = np.random.default_rng(1)
    x, z = rng.standard_normal((4, 5)).astype(dtype), rng.standard_normal((5, 3)).astype(dtype)
    want_x, want_z = _reference_gradients(x.astype(np.float64), z.astype(np.float64))
    args = engine.asarray(x, CPU), engine.asarray(z, CPU)
    gradient = engine.gradient(_loss(engine.namespace(CPU)), 0)(*args)
    both = engine.gradient(_loss(engine.namespace(CPU)), (0, 1))(*args)
    assert isinstance(both, tuple) and len(both) == 2
    assert engine.to_numpy(gradient).dtype == np.dtype(dtype)
    computed_in = engine.computes_in(dtype)
    tolerance = gradient_tolerance(computed_in)  # bfloat16's for autocast from float32 data
    assert max_relative_error(gradient, want_x) < tolerance
    assert max_relative_error(both, (want_x, want_z)) < tolerance


def test_manual_engine_returns_the_workloads_gradient_and_requires_one():
    def hand_written(x):
        return 2 * x

    def seed_written(x):
        return x + x

    assert get_engine("manual").gradient(None, 0, manual=hand_written) is hand_written
    both = {"manual": hand_written, "manual-seed": seed_written}
    assert get_engine("manual").gradient(None, 0, manual=both) is hand_written
    assert get_engine("manual-seed").gradient(None, 0, manual=both) is seed_written
    with pytest.raises(NotApplicableError, match="'manual-seed': this workload has no such hand-written gradient"):
        get_engine("manual-seed").gradient(None, 0, manual=hand_written)
    with pytest.raises(ValueError, match="pass manual="):
        get_engine("manual").gradient(None, 0)
    with pytest.raises(ValueError, match="argnum must be an int or a non-empty tuple"):
        get_engine("torch").gradient(lambda x: x, [0])


def test_torch_namespace_has_numpy_semantics():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 3, 4))
    t = torch.from_numpy(a)
    np_ns, torch_ns = namespaces.numpy_namespace(), namespaces.torch_namespace()
    for name in namespaces.OP_NAMES:
        assert hasattr(np_ns, name) and hasattr(torch_ns, name) and hasattr(namespaces.autograd_namespace(), name)
    cases = [
        ("sum", (), {}), ("sum", (), {"axis": 1}), ("sum", (), {"axis": 2, "keepdims": True}),
        ("sum", (), {"keepdims": True}), ("mean", (), {"axis": 0}), ("transpose", (), {}),
        ("transpose", ((0, 2, 1),), {}), ("maximum", (0.1,), {}), ("relu", (), {}), ("tanh", (), {}),
        ("reshape", ((4, 6),), {}),
    ]
    for name, args, kwargs in cases:
        want = getattr(np_ns, name)(a, *args, **kwargs)
        got = getattr(torch_ns, name)(t, *args, **kwargs).numpy()
        assert got.shape == np.shape(want), (name, kwargs)
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{name} {kwargs}")
    m = rng.standard_normal((4, 5))
    np.testing.assert_allclose(torch_ns.dot(torch.from_numpy(a[0]), torch.from_numpy(m)).numpy(), a[0] @ m)


def test_max_relative_error_is_relative_to_the_largest_entry_and_never_passes_nan():
    reference = (np.array([10.0, -20.0]), np.array([[0.0]]))
    assert max_relative_error((np.array([10.0, -19.0]), np.array([[0.5]])), reference) == pytest.approx(1.0 / 20)
    assert math.isnan(max_relative_error(np.array([np.nan, 1.0]), np.array([1.0, 1.0])))
    with pytest.raises(ValueError, match="shape"):
        max_relative_error(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="2 arrays, the reference 1"):
        max_relative_error((np.zeros(2), np.zeros(2)), np.zeros(2))


def test_saved_gradients_round_trip_without_pickle_and_compare_with_the_reference(tmp_path):
    manual = (np.arange(6.0).reshape(2, 3), np.array(4.0))
    save_gradient(manual, tmp_path, "manual")
    save_gradient((torch.from_numpy(manual[0]) * 1.001, torch.tensor(4.0)), tmp_path, "torch")
    back = load_gradient(tmp_path, "manual")
    assert [a.shape for a in back] == [(2, 3), ()] and all(a.dtype != object for a in back)
    np.testing.assert_array_equal(back[0], manual[0])
    assert saved_gradient_error(tmp_path, "torch") == pytest.approx(5 * 0.001 / 5)
    with pytest.raises(FileNotFoundError, match="no gradient saved for 'autograd'"):
        saved_gradient_error(tmp_path, "autograd")


@pytest.mark.slow
def test_the_parent_compares_each_saved_gradient_with_manuals_and_deletes_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    comparison = compare_engines(
        Cases("b", "engine_targets:case", {"off": {"off_by": 1e-3}, "manual fails": {"failing": "manual"}}),
        {"engines": ["torch", "manual"], "dtype": "float64"}, device="cpu", progress=None)
    assert os.listdir(tmp_path) == []
    frame = comparison.frame()
    assert list(dict.fromkeys(frame[frame["case"] == "off"]["variant"])) == ["manual", "torch"]  # manual first
    errors = frame[frame["metric"] == "grad_max_rel_err"]
    assert list(errors["variant"]) == ["torch"] and errors["value"].iloc[0] == pytest.approx(1e-3)
    with pytest.raises(GradientMismatch, match="torch"):
        comparison.check_gradients()
    unchecked = frame[frame["metric"] == "grad_check_unavailable"]
    assert list(zip(unchecked["case"], unchecked["variant"])) == [("manual fails", "torch")]
    summary = comparison.summary_frame().set_index(["case", "engine"])
    assert summary.loc[("manual fails", "torch"), "reason"] == (
        "gradient not checked: manual failed, so there is no gradient to compare with")
    assert summary.loc[("manual fails", "manual"), "status"] == "failed"
    assert "torch (manual fails): gradient not checked: manual failed" in comparison_text(comparison)


def test_check_gradients_says_what_was_checked_and_what_could_not_be():
    unchecked = make_record(benchmark="b", case="c", engine="autograd", device="cpu", dtype="float64",
                            metric="grad_check_unavailable", value=1.0, unit="",
                            params={"message": "manual failed, so there is no gradient to compare with"})
    comparison = EngineComparison("b", "cpu", "float64", records=(
        _records("torch", 150, 1.0, 2e-15) + _records("autograd", 150, 1.0) + [unchecked]))
    assert comparison.check_gradients().splitlines() == [
        "1 gradient(s) agree with manual within the float64 tolerance 1e-10 (grad_max_rel_err up to 2.00e-15)",
        "not checked: autograd (c): manual failed, so there is no gradient to compare with"]


def test_planning_adds_the_baseline_every_ratio_is_to_and_says_so():
    engines, note = planned_engines(["manual-seed", "torch", "torch-checkpoint"])
    assert engines == ["manual", "manual-seed", "torch", "torch-checkpoint"]
    assert note.startswith("manual added to the engines: it is the baseline of every ratio")
    assert planned_engines(["torch", "manual"]) == (["torch", "manual"], None)


@pytest.mark.slow
def test_a_comparison_without_manual_measures_it_in_the_same_run_and_its_table_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    said = []
    comparison = compare_engines(Cases("b", "engine_targets:case", {"c": {}}),
                                 {"engines": ["manual-seed", "torch"], "dtype": "float64"}, device="cpu",
                                 progress=said.append)
    summary = comparison.summary_frame().set_index("engine")
    assert list(summary.index) == ["manual", "manual-seed", "torch"]
    assert summary.loc["torch", "peak_ratio"] > 0 and summary.loc["torch", "grad_max_rel_err"] == 0
    assert said[0].startswith("b: manual added to the engines")
    lines = comparison_text(comparison).splitlines()
    assert lines[0] == comparison.notes[0] and "peak/manual" in lines[1] and "time/manual" in lines[1]


def test_engines_may_be_any_iterable_of_names_read_once():
    names = (name for name in ["manual", "torch"])
    assert validate_common(dtype="float32", engines=names, repeats=1, warmup=0) == ["manual", "torch"]


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "float16"}, "dtype must be one of float32, float64"),
    ({"engines": "torch"}, "list of engine names"),
    ({"engines": []}, "at least one"),
    ({"engines": ["torch", "torch"]}, "twice"),
    ({"engines": ["tf"]}, "unknown engine"),
    ({"repeats": 0}, "repeats must be"),
    ({"warmup": -1}, "warmup must be"),
    ({"trials": 0}, "trials must be"),
])
def test_bad_comparison_arguments_are_refused_with_what_is_valid(kwargs, message):
    arguments = {"dtype": "float64", "engines": ["manual"], "repeats": 1, "warmup": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        validate_common(**arguments)


def _records(engine, peak, time, error=None, dtype="float64", case="c"):
    labels = dict(benchmark="b", case=case, engine=engine, device="cpu", dtype=dtype)
    rows = [make_record(**labels, metric="peak_bytes", value=peak, unit="B"),
            make_record(**labels, metric="time", value=time, unit="s")]
    if error is not None:
        rows.append(make_record(**labels, metric="grad_max_rel_err", value=error, unit=""))
    return rows


def test_summary_gives_ratios_to_manual_and_gradient_mismatches_raise():
    comparison = EngineComparison("b", "cpu", "float64", records=(
        _records("manual", 100, 2.0) + _records("torch", 150, 1.0, 1e-14)
        + _records("benchlib-deferred", 200, 4.0, 1e-6)))
    summary = comparison.summary_frame().set_index("engine")
    assert list(summary.index) == ["manual", "benchlib-deferred", "torch"]
    assert summary.loc["benchlib-deferred", "peak_ratio"] == 2.0
    assert summary.loc["torch", "time_ratio"] == 0.5
    assert list(comparison.gradient_mismatches()["engine"]) == ["benchlib-deferred"]
    assert not comparison.ok
    with pytest.raises(GradientMismatch, match="benchlib-deferred"):
        comparison.check_gradients()


def _trial_records(engine, peaks, times):
    labels = dict(benchmark="b", case="c", engine=engine, device="cpu", dtype="float64")
    return [make_record(**labels, metric=metric, value=value, unit=unit, repeat=repeat, params={"trial": trial})
            for trial, (peak, trial_times) in enumerate(zip(peaks, times))
            for metric, unit, values in (("peak_bytes", "B", [peak]), ("time", "s", trial_times))
            for repeat, value in enumerate(values)]


def test_summary_ratios_are_medians_over_trials_with_an_interval_only_from_two_trials_a_side():
    comparison = EngineComparison("b", "cpu", "float64", records=(
        _trial_records("manual", [100, 100, 100], [[1.0, 9.0, 1.0], [1.0], [1.0]])
        + _trial_records("torch", [200, 200, 200], [[2.0], [2.0], [2.0]])))
    summary = comparison.summary_frame().set_index("engine")
    assert summary.loc["torch", "trials"] == 3
    assert summary.loc["torch", ["peak_ratio", "peak_ratio_low", "peak_ratio_high"]].tolist() == [2.0, 2.0, 2.0]
    # the 9 s repeat sits inside trial 0, whose median stays 1 s: one slow repeat is not a trial
    assert summary.loc["torch", ["time_ratio", "time_ratio_low", "time_ratio_high"]].tolist() == [2.0, 2.0, 2.0]
    single = EngineComparison("b", "cpu", "float64", records=(
        _trial_records("manual", [100], [[1.0]]) + _trial_records("torch", [150], [[1.0]]))).summary_frame().set_index("engine")
    assert single.loc["torch", "peak_ratio"] == 1.5 and math.isnan(single.loc["torch", "peak_ratio_low"])


MANUAL_FIRST = "manual".__eq__


@pytest.mark.slow
def test_trials_run_interleaved_in_fresh_processes_and_record_their_trial_and_place():
    comparison = compare_engines(
        Cases("dot_chain", "benchlib.workloads.dot_chain:case", {"c": {"D": 6, "depth": 3}}),
        {"engines": ["benchlib-inplace", "manual"], "dtype": "float64", "trials": 2, "order_seed": 3}, device="cpu",
        progress=None)
    frame = comparison.frame()
    params = frame[frame["metric"] == "peak_bytes"]["params"].map(json.loads)
    placed = sorted((p["position"], p["trial"], name) for p, name in zip(params, frame.loc[params.index, "variant"]))
    assert [(trial, name) for _, trial, name in placed] == trial_order(["benchlib-inplace", "manual"], 2, seed=3, opens=MANUAL_FIRST)
    assert all(p["trials"] == 2 and p["order_seed"] == 3 for p in params)
    errors = frame[frame["metric"] == "grad_max_rel_err"]
    assert len(errors) == 2 and (errors["value"] < 1e-12).all()  # every trial's gradient checked
    assert comparison.summary_frame().set_index("engine").loc["benchlib-inplace", "trials"] == 2


def test_summary_lists_cases_that_did_not_run():
    problems = [Problem("c", "autograd", "not applicable", "CPU only")]
    table = summarize(records_frame(_records("manual", 100, 2.0)), problems).set_index("engine")
    assert table.loc["autograd", "status"] == "not applicable"
    assert table.loc["autograd", "reason"] == "CPU only"
    assert math.isnan(table.loc["autograd", "peak_ratio"])


def test_an_engine_that_cannot_run_on_the_device_is_recorded_not_dropped(monkeypatch):
    monkeypatch.setattr(benchlib.measure, "resolve_device", lambda spec: CUDA)
    from benchlib.workloads import dot_chain

    # engines as a generator: validated once, by compare_engines, and read once
    comparison = compare_engines(  # manual, added by planning, is kept from running on this pretended device
        Cases("dot_chain", dot_chain.TARGET, {"c": {"D": 3, "depth": 2}},
              not_applicable=lambda engine: "not in this test" if engine == "manual" else None),
        {"engines": (name for name in ["autograd"]), "dtype": "float32"}, device="cuda", progress=None)
    (record,) = [record for record in comparison.records if record["variant"] == "autograd"]
    assert (record["variant"], record["metric"], record["device"]) == ("autograd", "not_applicable", "cuda:0")
    assert json.loads(record["params"])["message"].startswith("HIPS autograd computes with NumPy")
    assert comparison.ok


@pytest.mark.slow
def test_a_failing_case_becomes_a_failed_record_and_the_others_survive():
    comparison = compare_engines(
        Cases("dot_chain", "benchlib.workloads.dot_chain:case",
              {"good": {"D": 6, "depth": 3}, "bad": {"D": 6, "depth": 3, "bogus": 1}}),
        {"engines": ["manual"], "dtype": "float64"}, device="cpu", progress=None)
    frame = comparison.frame()
    assert set(frame[frame["case"] == "good"]["metric"]) >= {"time", "peak_bytes", "x_scale"}
    (failed,) = comparison.problems
    assert failed.case == "bad" and failed.status == "failed"
    assert "unexpected keyword argument 'bogus'" in failed.message
    assert list(frame[frame["case"] == "bad"]["metric"]) == ["failed"]
    assert not comparison.ok


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in AUTOMATIC if n != "autograd"])
def test_engines_compute_on_cuda_tensors(name):
    engine = get_engine(name)
    rng = np.random.default_rng(3)
    x, z = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    args = engine.asarray(x, CUDA), engine.asarray(z, CUDA)
    assert args[0].device.type == "cuda"
    gradient = engine.gradient(_loss(engine.namespace(CUDA)), 0)(*args)
    assert gradient.device.type == "cuda"
    assert max_relative_error(gradient, _reference_gradients(x, z)[0]) < GRADIENT_TOLERANCE["float64"]


@pytest.mark.parametrize("labels_kind", ["indices", "probabilities"])
def test_losses_agree_across_namespaces_and_with_benchlib_ops(labels_kind):
    from benchlib.autodiff import ops

    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, 3))
    labels = rng.integers(0, 3, size=5) if labels_kind == "indices" else rng.dirichlet(np.ones(3), size=5)
    prediction, target = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    want_ce = float(ops.softmax_cross_entropy(logits, labels))
    want_mse = float(ops.mse(prediction, target))
    for xp in (namespaces.numpy_namespace(), namespaces.autograd_namespace()):
        assert float(xp.softmax_cross_entropy(logits, labels)) == pytest.approx(want_ce, rel=1e-12)
        assert float(xp.mse(prediction, target)) == pytest.approx(want_mse, rel=1e-12)
    torch_ns = namespaces.torch_namespace()
    assert float(torch_ns.softmax_cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels))) == pytest.approx(
        want_ce, rel=1e-12)
    assert float(torch_ns.mse(torch.from_numpy(prediction), torch.from_numpy(target))) == pytest.approx(want_mse, rel=1e-12)


def _timelines():
    rows = []
    for engine, scale in (("manual", 1.0), ("benchlib-deferred", 2.0)):
        for t, phase, megabytes in ((0.0, "", 0), (0.1, "forward", 1), (0.2, "forward", 5), (0.3, "backward", 8),
                                    (0.4, "backward", 3)):
            rows.append({"case": "c", "engine": engine, "t_s": t, "bytes": int(megabytes * scale * 1e6), "phase": phase})
    return pd.DataFrame(rows)


def test_memory_timeline_figure_draws_each_engine_with_a_marker_where_each_phase_begins():
    from benchlib.report.plots import gradients

    records = records_frame(_records("manual", 8e6, 1.0) + [make_record(
        benchmark="b", case="c", engine="autograd", device="cuda:0", dtype="float32", metric="not_applicable",
        value=1.0, unit="", params={"message": "CPU only"})])
    figure = gradients.memory_timelines(_timelines(), records=records)
    lines = [trace for trace in figure.data if trace.mode == "lines"]
    markers = [trace for trace in figure.data if trace.mode == "markers"]
    assert [trace.name for trace in lines] == ["manual", "benchlib-deferred"]
    assert list(markers[1].x) == [0.1, 0.3] and list(markers[1].text) == ["forward", "backward"]
    assert list(markers[1].y) == [2.0, 16.0]
    assert "autograd: not applicable (CPU only)" in figure.layout.annotations[0].text
    with pytest.raises(ValueError, match="valid cases"):
        gradients.memory_timelines(_timelines(), case="other")


def test_peak_bars_label_each_engine_with_its_ratio_to_manual():
    from benchlib.report.plots import gradients

    figure = gradients.peak_bars(records_frame(_records("manual", 100e6, 1.0) + _records("benchlib-deferred", 197e6, 1.0)))
    assert [(bar.x[0], bar.y[0], bar.text[0]) for bar in figure.data] == [
        ("manual", 100.0, "100.0 MB<br>1.000x manual"), ("benchlib-deferred", 197.0, "197.0 MB<br>1.970x manual")]
    small = gradients.peak_bars(records_frame(_records("manual", 0.33e6, 1.0)))  # below a MB: never "0 MB"
    assert small.data[0].text[0].startswith("330.0 kB")


def test_sweep_lines_read_the_swept_parameter_from_params():
    from benchlib.report.plots import gradients

    rows = []
    for T, peak in ((10, 1e6), (20, 2e6)):
        labels = dict(benchmark="b", case=f"T={T}", engine="manual", device="cpu", dtype="float32", params={"T": T})
        rows += [make_record(**labels, metric="peak_bytes", value=peak, unit="B"),
                 make_record(**labels, metric="time", value=T / 10, unit="s")]
    figure = gradients.sweep_lines(records_frame(rows), parameter="T")
    peak_line, time_line = figure.data
    assert list(peak_line.x) == [10, 20] and list(peak_line.y) == [1.0, 2.0] and list(time_line.y) == [1.0, 2.0]
    with pytest.raises(ValueError, match="'depth' is missing"):
        gradients.sweep_lines(records_frame(rows), parameter="depth")


@pytest.mark.parametrize("steps, lengths", [
    (0, []), (1, [1]), (3, [2, 1]), (8, [3, 3, 2]), (100, [10] * 10), (200, [14] * 5 + [13] * 10)])
def test_torch_checkpoint_cuts_a_chain_into_ceil_sqrt_segments_of_near_equal_length(steps, lengths):
    assert namespaces.checkpoint_segments(steps) == lengths
    assert sum(lengths) == steps


def test_torch_checkpoint_runs_one_non_reentrant_checkpoint_per_segment_without_rng_state(monkeypatch):
    import torch.utils.checkpoint

    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counted(function, *args, **kwargs):
        calls.append((args[-1], kwargs))
        return original(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    xp = namespaces.torch_checkpoint_namespace()
    calls.clear()  # the priming call at set-up, if this process had not made it yet
    state = torch.ones(3, requires_grad=True)
    assert torch.equal(xp.chain(lambda s: s * 2, state, 8), state * 2 ** 8)
    assert [length for length, _ in calls] == [3, 3, 2]
    assert all(kwargs == {"use_reentrant": False, "preserve_rng_state": False} for _, kwargs in calls)


@pytest.mark.slow
def test_records_carry_the_segmentation_of_torch_checkpoint_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    comparison = compare_engines(
        Cases("b", "engine_targets:case", {"c": {}},
              engine_params=lambda engine, _params: namespaces.segmentation_params(engine, 100)),
        {"engines": ["manual", "torch-checkpoint"], "dtype": "float64"}, device="cpu", progress=None)
    frame = comparison.frame()
    params = {row.variant: json.loads(row.params) for row in frame[frame["metric"] == "peak_bytes"].itertuples()}
    assert params["torch-checkpoint"]["checkpoint_segments"] == 10
    assert params["torch-checkpoint"]["checkpoint"].startswith("10 segments of 10 steps (⌈√100⌉)")
    assert "checkpoint" not in params["manual"]


@pytest.mark.slow
def test_an_interrupted_comparison_saves_the_finished_trials_into_the_run_before_the_interrupt_goes_on(tmp_path):
    import benchlib.measure
    from benchlib.records import Run, load_records
    from benchlib.trials import Interrupted

    real, calls = benchlib.measure.run_isolated, []

    def interrupted_on_the_fourth(*args, **kwargs):  # Ctrl-C while the fourth trial runs
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    run, said = Run.open(tmp_path / "run"), []
    with pytest.raises(Interrupted):
        compare_engines(Cases("dot_chain", "benchlib.workloads.dot_chain:case", {"c": {"D": 6, "depth": 3}}),
                        {"engines": ["benchlib-inplace", "manual"], "dtype": "float64", "trials": 3}, device="cpu",
                        progress=said.append, results=run, isolate=interrupted_on_the_fourth)
    kept = load_records(run.path)
    assert (kept["metric"] == "time").sum() == 3  # the three trials that finished, none lost
    assert any("interrupted; the" in line and str(run.path) in line for line in said)
