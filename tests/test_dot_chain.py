"""The dot-chain workload: data, hand-written gradient, every engine against it, the notebook."""

import io

import numpy as np
import pandas as pd
import pytest
import torch

from benchlib.engines import ENGINE_NAMES, get_engine
from benchlib.engines.gradients import (GRADIENT_TOLERANCE, gradient_tolerance, load_gradient, max_relative_error,
                                        saved_gradient_error)
from benchlib.measure import Device
from benchlib.workloads import dot_chain

CPU = Device("cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _chain_value(x, z, depth):
    for _ in range(depth):
        z = x @ z
    return z.sum()


def test_data_is_scaled_to_spectral_norm_one_so_long_chains_stay_finite():
    x, z, scale = dot_chain.make_data(40, "float64", seed=3)
    assert np.linalg.norm(x, 2) == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_array_equal(x, x.T)
    assert 0 < scale < 1
    assert np.isfinite(_chain_value(x, z, 100))
    x32, _, scale32 = dot_chain.make_data(40, "float32", seed=3)
    assert x32.dtype == np.float32 and scale32 == scale


def test_manual_gradient_matches_central_differences():
    x, z, _ = dot_chain.make_data(5, "float64", seed=1)
    depth, step = 4, 1e-6
    gradient = dot_chain.manual_gradient(get_engine("manual").namespace(CPU), depth)(x, z)
    numeric = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        bump = np.zeros_like(x)
        bump[index] = step
        numeric[index] = (_chain_value(x + bump, z, depth) - _chain_value(x - bump, z, depth)) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-8)


def _run_case(engine, gradient_dir, device=CPU, dtype="float64", D=12, depth=8, wrong_by=0.0):
    """One case as the isolation child runs it: the call, then the check (which saves the gradient)."""
    case = dot_chain.case(device=device, engine=engine, D=D, depth=depth, dtype=dtype, gradient_dir=str(gradient_dir))
    result = case.fn()
    return result, case.check(result * (1 + wrong_by) if wrong_by else result)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("engine", [name for name in ENGINE_NAMES if name != "manual"])
def test_every_engine_agrees_with_manual_through_the_case_and_its_saved_gradient(engine, dtype, tmp_path):
    _run_case("manual", tmp_path, dtype=dtype)
    result, checks = _run_case(engine, tmp_path, dtype=dtype)
    chosen = get_engine(engine)
    assert chosen.to_numpy(result).dtype == np.dtype(dtype)
    computed_in = chosen.computes_in(dtype)
    assert saved_gradient_error(tmp_path, engine) <= gradient_tolerance(computed_in)
    assert checks.pop("x_scale") == dot_chain.make_data(12, "float64")[2]
    # the rest says where the peak goes: both roles from benchlib's tape; torch's saved tensors come from
    # the role timeline's call (its gauge's metrics), not from one more call in every check; the compile's time
    roles = {"autograd": set(), "manual-seed": set(), "torch": set(), "torch-checkpoint": set(), "torch-sac": set(),
             "torch-autocast": set(), "torch.compile": {"compile_time"}}
    assert set(checks) == roles.get(engine, {"role_saved_bytes", "role_gradient_bytes"})


@pytest.mark.parametrize("engine", ["torch", "torch-checkpoint"])
def test_torchs_saved_bytes_come_from_the_call_its_role_gauge_watched(engine, tmp_path):
    case = dot_chain.case(device=CPU, engine=engine, D=12, depth=8, dtype="float64", gradient_dir=str(tmp_path))
    context = case.roles()
    with context:
        case.fn()
    saved = context.metrics()["role_saved_bytes"]
    full = (8 - 1) * 12 * 12 * 8  # z_1..z_7, as benchlib's tape saves them
    assert saved == full if engine == "torch" else 0 < saved < full


def test_the_check_would_catch_a_wrong_gradient(tmp_path):
    _run_case("manual", tmp_path)
    _run_case("torch", tmp_path, wrong_by=1e-3)
    assert saved_gradient_error(tmp_path, "torch") == pytest.approx(1e-3, rel=1e-6)


def test_memory_requirement_counts_the_z_stack_and_the_kept_contributions_of_deferred():
    inplace = dot_chain.memory_required_bytes("benchlib-inplace", 1000, 100, "float64")
    deferred = dot_chain.memory_required_bytes("benchlib-deferred", 1000, 100, "float64")
    assert inplace > 100 * 1000 * 1000 * 8
    assert deferred - inplace >= 100 * 1000 * 1000 * 8
    assert dot_chain.memory_required_bytes("manual", 1000, 100, "float32") * 2 == pytest.approx(
        dot_chain.memory_required_bytes("manual", 1000, 100, "float64"))


@pytest.mark.parametrize("kwargs, message", [
    ({"D": 0}, "D must be an integer >= 1"),
    ({"depth": 2.5}, "depth must be an integer >= 1"),
    ({"dtype": "int32"}, "dtype must be one of float32, float64"),
    ({"engines": ["manual", "jax"]}, "'jax' is not valid"),
    ({"engines": ["manual", "manual"]}, "engines lists a value twice"),
    ({"malloc": "jemalloc"}, "malloc must be one of mmap-128k, mmap-64k, glibc-default, training-process"),
])
def test_bad_arguments_are_refused_by_the_declaration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dot_chain.BENCHMARK.config(kwargs)


def test_the_command_line_takes_every_declared_parameter_and_refuses_bad_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        dot_chain.main(["--D", "0"])
    assert exit_.value.code == 2 and "D must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_benchmark_script_prints_the_table(capsys):
    assert dot_chain.main(["--D", "16", "--depth", "4", "--engines", "manual", "torch", "--dtype", "float32"]) == 0
    table = capsys.readouterr().out
    assert "peak/manual" in table and "time/manual" in table  # each ratio headed by its baseline
    rows = [line.split()[:3] for line in table.splitlines()[1:]]
    assert rows == [["D=16,depth=4", "manual", "ok"], ["D=16,depth=4", "torch", "ok"]]


@pytest.mark.slow
def test_notebook_runs_with_quick_sizes_and_writes_every_engines_records(tmp_path):
    from benchlib.runner import run

    result = run(["dot_chain"], device="cpu", out=tmp_path, quick=True, progress=False, stream=io.StringIO())
    assert result.ok, result.status_table()
    records = pd.read_parquet(result.path / "records" / "dot_chain.parquet")
    first_look = dot_chain.BENCHMARK.parameter("engines").default  # every engine but the compiling one
    assert set(first_look) == set(ENGINE_NAMES) - {"torch.compile"}
    assert set(records["variant"]) == set(first_look)
    assert set(records["device"]) == {"cpu"} and set(records["dtype"]) == {"float64"}
    autocast = records[records["variant"] == "torch-autocast"]  # float64: not lowered, said why
    assert list(autocast["metric"]) == ["not_applicable"]
    measured = [engine for engine in first_look if engine != "torch-autocast"]
    for engine in measured:
        metrics = set(records[records["variant"] == engine]["metric"])
        assert {"time", "peak_bytes", "x_scale"} <= metrics
        assert ("grad_max_rel_err" in metrics) == (engine != "manual")
    assert set(records["case"]) == {"D=64,depth=8"}
    for figure in ("dot_chain_memory_timeline", "dot_chain_peak"):
        assert (result.path / "figures" / f"{figure}.html").is_file()
    timelines = pd.read_parquet(result.path / "tables" / "dot_chain_timelines.parquet")
    assert list(timelines.columns) == ["benchmark", "case", "engine", "device", "dtype", "t_s", "bytes", "phase"]
    assert set(timelines["engine"]) == set(measured)
    assert {"forward", "backward"} <= set(timelines["phase"])
    roles = pd.read_parquet(result.path / "tables" / "dot_chain_role_timelines.parquet")
    assert set(roles["engine"]) == {e for e in measured if e.startswith(("benchlib-", "torch"))}
    assert roles.loc[roles["engine"].str.startswith("torch"), "gradients"].isna().all()
    assert roles.loc[roles["engine"].str.startswith("benchlib-"), "gradients"].notna().all()
    assert (result.path / "figures" / "dot_chain_role_timeline.html").is_file()


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["manual", "benchlib-inplace", "benchlib-deferred", "torch"])
def test_cases_run_on_cuda_tensors_and_agree_with_manual_on_the_cpu(engine, tmp_path):
    _run_case("manual", tmp_path, dtype="float32", D=64, depth=10)
    (tmp_path / "cuda").mkdir()
    result, _ = _run_case(engine, tmp_path / "cuda", device=Device("cuda", 0), dtype="float32", D=64, depth=10)
    assert result.device.type == "cuda"
    assert max_relative_error(load_gradient(tmp_path / "cuda", engine),
                              load_gradient(tmp_path, "manual")) <= GRADIENT_TOLERANCE["float32"]


needs_memray = pytest.mark.skipif(not __import__("benchlib.measure.allocations", fromlist=["x"]).memray_available(),
                                  reason="memray is not installed")


def _tracked_peak_buffers(engine, D=128, depth=16, tmp_path="."):
    """The bytes live at once during a warm gradient call, as memray's allocator records count them
    (the same for the same code path: exact, not a timing), in D×D float64 buffers."""
    from benchlib.measure.allocations import count_allocations

    case = dot_chain.case(device=CPU, engine=engine, D=D, depth=depth, dtype="float64", gradient_dir=str(tmp_path))
    case.fn()
    return count_allocations(case.fn, CPU).peak_bytes / (D * D * 8)


@needs_memray
def test_torch_checkpoint_holds_the_segment_boundaries_and_one_recomputed_segment_far_below_torch(tmp_path):
    checkpointed = _tracked_peak_buffers("torch-checkpoint", tmp_path=tmp_path)
    plain = _tracked_peak_buffers("torch", tmp_path=tmp_path)
    # depth 16: 4 segments of 4 steps; 4 boundaries + 4 recomputed z's + g_z, g_x and a product in flight
    assert checkpointed <= 4 + 4 + 3 + 0.5  # and under half a buffer of small objects (holders, nodes)
    assert plain >= 16 and checkpointed < 0.6 * plain
