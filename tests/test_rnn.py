"""The RNN fan-out workload: hand-written BPTT, every engine against it, the fan-out cost, the notebook."""

import io
import json

import numpy as np
import pandas as pd
import pytest
import torch

from benchlib.engines import ENGINE_NAMES, get_engine
from benchlib.engines.gradients import GRADIENT_TOLERANCE, load_gradient, max_relative_error, saved_gradient_error
from benchlib.measure import Device
from benchlib.workloads import rnn

CPU = Device("cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _arguments(batch, hidden, dtype="float64", seed=0):
    data = rnn.make_data(batch, hidden, dtype, seed)
    return [data[name] for name in (*rnn.WEIGHTS, "x", "label")]


def test_data_follows_bench_rnn():
    data = rnn.make_data(16, 1024, "float32")
    assert {value.dtype for value in data.values()} == {np.dtype("float32")}
    assert {name: value.shape for name, value in data.items()} == {
        "W": (1024, 1024), "b": (1024,), "Wout": (1024, 1), "bout": (1,), "x": (16, 1024), "label": (16, 1)}
    assert set(np.unique(data["label"])) <= {0.0, 1.0}
    assert data["W"].std() == pytest.approx(0.01, rel=0.01)


@pytest.mark.parametrize("loss_of, gradient_of", [
    (rnn.rnn_loss, rnn.manual_gradient),  # per-step-loss
    (rnn.bench_rnn_loss, rnn.bench_rnn_manual_gradient),  # bench_rnn, the lean floor
    (rnn.bench_rnn_loss, rnn.bench_rnn_seed_gradient),  # bench_rnn as its own benchmark writes it
])
def test_hand_written_bptt_matches_central_differences_for_every_weight(loss_of, gradient_of):
    args = [a * 50 for a in _arguments(batch=3, hidden=4)[:5]] + _arguments(batch=3, hidden=4)[5:]
    T, step = 5, 1e-6
    loss = loss_of(get_engine("manual").namespace(CPU), T)
    gradients = gradient_of(get_engine("manual").namespace(CPU), T)(*args)
    assert len(gradients) == 4
    for position, gradient in enumerate(gradients):
        assert gradient.shape == args[position].shape
        numeric = np.zeros_like(gradient)
        for index in np.ndindex(*gradient.shape):
            up = [a.copy() for a in args]
            down = [a.copy() for a in args]
            up[position][index] += step
            down[position][index] -= step
            numeric[index] = (loss(*up) - loss(*down)) / (2 * step)
        assert max_relative_error(gradient, numeric) < 1e-7, rnn.WEIGHTS[position]


def _run_case(engine, gradient_dir, device=CPU, dtype="float64", hidden=16, wrong_bout_by=0.0, model="per-step-loss"):
    """One case as the isolation child runs it: the call, then the check (which saves the gradients)."""
    case = rnn.case(device=device, engine=engine, batch=4, hidden=hidden, T=6, dtype=dtype,
                    gradient_dir=str(gradient_dir), model=model)
    dW, db, dWout, dbout = result = case.fn()
    checks = case.check((dW, db, dWout, dbout * (1 + wrong_bout_by)) if wrong_bout_by else result)
    # where the peak goes, and what compiling took; nothing else
    assert set(checks) <= {"role_saved_bytes", "role_gradient_bytes", "compile_time"}
    return result


@pytest.mark.slow
@pytest.mark.parametrize("model", list(rnn.MODELS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("engine", [name for name in ENGINE_NAMES if name not in ("manual", "torch-autocast")])
def test_every_engine_agrees_with_manual_through_the_case_and_its_saved_gradients(engine, dtype, model, tmp_path):
    if engine == "manual-seed" and model not in rnn.SEED_GRADIENT_MODELS:
        pytest.skip("no seed-written gradient for this model (recorded as not applicable: tested below)")
    _run_case("manual", tmp_path, dtype=dtype, model=model)
    result = _run_case(engine, tmp_path, dtype=dtype, model=model)
    assert [get_engine(engine).to_numpy(g).dtype for g in result] == [np.dtype(dtype)] * 4
    assert [g.shape for g in load_gradient(tmp_path, engine)] == [(16, 16), (16,), (16, 1), (1,)]
    assert saved_gradient_error(tmp_path, engine) <= GRADIENT_TOLERANCE[dtype]


@pytest.mark.slow
def test_manual_seed_is_not_applicable_to_a_model_without_a_seed_gradient_and_unknown_models_are_refused():
    config = rnn.BENCHMARK.config({"model": "per-step-loss", "batch": 2, "hidden": 8, "T": 3, "T_sweep": [3],
                                   "engines": ["manual", "manual-seed"], "trials": 1, "repeats": 1})
    comparison = rnn.run(config, "cpu", progress=None)
    assert [(p.engine, p.status) for p in comparison.problems] == [("manual-seed", "not applicable")]
    assert "has no seed-written gradient (only bench_rnn does)" in comparison.problems[0].message
    with pytest.raises(ValueError, match="model must be one of bench_rnn, per-step-loss"):
        rnn.BENCHMARK.config({"model": "lstm"})


def test_the_check_would_catch_a_wrong_gradient_of_one_weight(tmp_path):
    _run_case("manual", tmp_path)
    _run_case("autograd", tmp_path, wrong_bout_by=0.01)
    assert saved_gradient_error(tmp_path, "autograd") > GRADIENT_TOLERANCE["float64"]


def _gradient_peak_bytes(accumulate, T, hidden=32, batch=2):
    """benchlib.autodiff's exact count of live gradient bytes during one backward pass."""
    engine = get_engine(f"benchlib-{accumulate}")
    gradient = engine.gradient(rnn.rnn_loss(engine.namespace(CPU), T), rnn.WEIGHT_ARGNUMS)
    gradient(*_arguments(batch, hidden))
    return gradient.stats.peak_bytes


def test_deferred_gradient_memory_grows_by_a_weight_matrix_per_step_and_inplace_does_not():
    hidden, w_bytes = 32, 32 * 32 * 8
    deferred_growth = _gradient_peak_bytes("deferred", 12, hidden) - _gradient_peak_bytes("deferred", 4, hidden)
    inplace_growth = _gradient_peak_bytes("inplace", 12, hidden) - _gradient_peak_bytes("inplace", 4, hidden)
    assert deferred_growth >= 8 * w_bytes
    assert inplace_growth < w_bytes


def test_memory_requirement_grows_with_T_by_a_weight_matrix_for_deferred_only():
    def growth(engine):
        return rnn.memory_required_bytes(engine, 16, 1024, 100, "float32") - rnn.memory_required_bytes(
            engine, 16, 1024, 50, "float32")

    assert growth("benchlib-deferred") >= 50 * 1024 * 1024 * 4
    assert growth("benchlib-inplace") < 50 * 1024 * 1024 * 4 / 4


def test_growth_per_step_is_the_slope_of_the_measured_peak_against_T_in_W_buffers():
    from benchlib.records import make_record, records_frame

    w_bytes = 32 * 32 * 4
    rows = []
    for engine, per_step in (("benchlib-deferred", w_bytes), ("benchlib-inplace", 256)):
        for T in (10, 20, 40):
            labels = dict(benchmark="rnn_fanout", case=f"T={T}", engine=engine, device="cpu", dtype="float32",
                          params={"T": T, "hidden": 32, "batch": 2})
            rows += [make_record(**labels, metric="peak_bytes", value=5000 + per_step * T, unit="B"),
                     make_record(**labels, metric="time", value=0.01 * T, unit="s", repeat=0),
                     make_record(**labels, metric="time", value=0.01 * T + 1, unit="s", repeat=1),
                     make_record(**labels, metric="time", value=0.01 * T + 0.002, unit="s", repeat=2)]
    rows.append(make_record(benchmark="rnn_fanout", case="T=10", engine="torch", device="cpu", dtype="float32",
                            metric="peak_bytes", value=1.0, unit="B", params={"T": 10, "hidden": 32}))
    rows.append(make_record(benchmark="rnn_fanout", case="T=10", engine="torch", device="cpu", dtype="float32",
                            metric="time", value=1.0, unit="s", params={"T": 10, "hidden": 32}))
    growth = rnn.growth_per_step(records_frame(rows)).set_index("engine")
    assert growth.loc["benchlib-deferred", "peak_per_step_in_W"] == pytest.approx(1.0)
    assert growth.loc["benchlib-inplace", "peak_bytes_per_step"] == pytest.approx(256)
    assert growth.loc["benchlib-inplace", "time_s_per_step"] == pytest.approx(0.01)  # medians, not means
    assert growth.loc["torch", "T_values"] == 1 and np.isnan(growth.loc["torch", "peak_bytes_per_step"])


@pytest.mark.parametrize("kwargs, message", [
    ({"T_sweep": []}, "non-empty list"),
    ({"T_sweep": 50}, "non-empty list"),
    ({"T_sweep": [10, 0]}, "0 is not valid"),
    ({"T_sweep": [10, 10]}, "twice"),
    ({"hidden": -1}, "hidden must be an integer >= 1"),
    ({"repeats": 0}, "repeats must be"),
])
def test_bad_arguments_are_refused_by_the_declaration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rnn.BENCHMARK.config(kwargs)


@pytest.mark.slow
def test_notebook_runs_with_quick_sizes_and_writes_every_engines_records_for_every_T(tmp_path):
    from benchlib.runner import run

    result = run(["rnn_fanout"], device="cpu", out=tmp_path, quick=True, progress=False, stream=io.StringIO())
    assert result.ok, result.status_table()
    records = pd.read_parquet(result.path / "records" / "rnn_fanout.parquet")
    assert set(records["case"]) == {"T=2", "T=4"}
    assert set(records["dtype"]) == {"float32"}
    for (case, engine), group in records.groupby(["case", "variant"]):
        metrics = set(group["metric"])
        assert {"time", "peak_bytes"} <= metrics, (case, engine)
        assert ("grad_max_rel_err" in metrics) == (engine != "manual")
    first_look = rnn.BENCHMARK.parameter("engines").default
    assert set(first_look) == set(ENGINE_NAMES) - {"torch.compile", "torch-autocast"}
    assert set(records["variant"]) == set(first_look)
    for figure in ("rnn_fanout_memory_timeline", "rnn_fanout_peak", "rnn_fanout_sweep", "rnn_fanout_role_timeline"):
        assert (result.path / "figures" / f"{figure}.html").is_file()
    timelines = pd.read_parquet(result.path / "tables" / "rnn_fanout_timelines.parquet")
    assert set(zip(timelines["case"], timelines["engine"])) == {(f"T={T}", e) for T in (2, 4) for e in first_look}


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["manual", "benchlib-inplace", "benchlib-deferred", "torch"])
def test_cases_run_on_cuda_tensors_and_agree_with_manual_on_the_cpu(engine, tmp_path):
    _run_case("manual", tmp_path, dtype="float32", hidden=64)
    (tmp_path / "cuda").mkdir()
    result = _run_case(engine, tmp_path / "cuda", device=Device("cuda", 0), dtype="float32", hidden=64)
    assert all(g.device.type == "cuda" for g in result)
    assert max_relative_error(load_gradient(tmp_path / "cuda", engine),
                              load_gradient(tmp_path, "manual")) <= GRADIENT_TOLERANCE["float32"]


needs_memray = pytest.mark.skipif(not __import__("benchlib.measure.allocations", fromlist=["x"]).memray_available(),
                                  reason="memray is not installed")


def _tracked_peak_bytes(engine, model, *, batch, hidden, T, tmp_path):
    """The bytes live at once during a warm gradient call, as memray's allocator records count them
    (the same for the same code path: exact, not a timing)."""
    from benchlib.measure.allocations import count_allocations

    case = rnn.case(device=CPU, engine=engine, batch=batch, hidden=hidden, T=T, dtype="float64",
                    gradient_dir=str(tmp_path), model=model)
    case.fn()
    return count_allocations(case.fn, CPU).peak_bytes


@needs_memray
@pytest.mark.parametrize("model", list(rnn.MODELS))
def test_the_lean_manual_gradient_holds_the_states_dW_and_one_scratch_and_nothing_more(model, tmp_path):
    batch, hidden, T = 4, 256, 20
    state, weight = batch * hidden * 8, hidden * hidden * 8
    peak = _tracked_peak_bytes("manual", model, batch=batch, hidden=hidden, T=T, tmp_path=tmp_path)
    # T stored states, dW and the reused scratch; dh and the small vectors stay under three states
    assert T * state + 2 * weight <= peak < T * state + 2 * weight + 3 * state
    if model == "bench_rnn":  # the seed's own code keeps more: its three stacks and a copy of each first contribution
        seed = _tracked_peak_bytes("manual-seed", model, batch=batch, hidden=hidden, T=T, tmp_path=tmp_path)
        assert seed > peak + weight


@needs_memray
@pytest.mark.parametrize("model", list(rnn.MODELS))
def test_torch_checkpoint_holds_less_than_torch_when_the_states_dominate(model, tmp_path):
    sizes = {"batch": 64, "hidden": 128, "T": 64, "tmp_path": tmp_path}  # a state is half of W
    assert (_tracked_peak_bytes("torch-checkpoint", model, **sizes)
            < 0.6 * _tracked_peak_bytes("torch", model, **sizes))


@pytest.mark.slow
def test_the_rnn_measures_with_hidden_states_mapped_and_records_the_segmentation():
    assert rnn.BENCHMARK.defaults()["malloc"] == "mmap-64k"
    assert rnn.chain_steps("bench_rnn", 200) == 200 and rnn.chain_steps("per-step-loss", 200) == 199
    config = rnn.BENCHMARK.config({"batch": 2, "hidden": 8, "T": 3, "T_sweep": [3], "engines": ["torch-checkpoint"],
                                   "trials": 1, "repeats": 1})
    comparison = rnn.run(config, "cpu", progress=None)
    frame = comparison.frame()
    params = frame[(frame["metric"] == "peak_bytes") & (frame["variant"] == "torch-checkpoint")]["params"].map(json.loads)
    assert params.iloc[0]["checkpoint_segments"] == 2 and params.iloc[0]["malloc_policy"] == "mmap-64k"
    assert comparison.notes[0].startswith("manual added")
