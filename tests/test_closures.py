"""identical_closures: the seed's MWEs under every engine, the protocol's records, the tables, the notebook."""

import io
import json

import numpy as np
import pandas as pd
import pytest

from benchlib.engines.gradients import GRADIENT_TOLERANCE, max_relative_error
from benchlib.measure import count_allocations
from benchlib.records import make_record, records_frame
from benchlib.report.plots.closures import steps_figure
from benchlib.report.plots.common import engine_color
from benchlib.workloads import closures
from benchlib.workloads.closures import INITIAL, NEW, RERUN, RESETUP, STEPS

TINY = closures.Protocol(warmup=1, repeats=2, cold_passes=1, alloc_passes=1, alloc_samples=2, backend="eager")


def _engine(name):
    return closures.make_engine(name, "cpu", backend="eager")


@pytest.mark.parametrize("mwe", closures.MWES)
@pytest.mark.parametrize("engine", closures.VALID_ENGINES)
def test_both_setups_give_bit_identical_gradients_that_match_the_hand_written_ones(engine, mwe):
    problem = closures.MWE(mwe, _engine(engine))
    grads1 = problem.train(problem.setup("setup1"))
    grads2 = problem.train(problem.setup("setup2"))
    assert closures.identical(grads1, grads2)
    reference = closures.gradients_numpy(closures.reference_gradients(mwe))
    error = max_relative_error(closures.gradients_numpy(grads1), reference)
    assert error <= GRADIENT_TOLERANCE[closures.MWE_DTYPES[mwe]]
    assert len(closures.gradients_numpy(grads1)) == (10 if mwe == "dense" else 1)  # 5 batches x (W, b)
    if mwe == "reduced":  # the seed's scalar stays a scalar under every engine
        assert closures.gradients_numpy(grads1)[0].shape == ()


def test_the_setups_build_distinct_code_objects_and_rebuilding_one_reuses_its_own():
    problem = closures.MWE("dense", _engine("torch"))
    first, second, again = problem.setup("setup1"), problem.setup("setup2"), problem.setup("setup1")
    assert first.code is not second.code and first.code.co_code == second.code.co_code
    assert again.code is first.code and again.loss is not first.loss


def test_the_hand_written_reference_matches_central_differences():
    arrays = {k: v.astype(np.float64) for k, v in closures.dense_arrays().items()}
    x, y = arrays["X"][:, :2], arrays["Y"][:, :2]

    def loss(W, b):
        return np.mean((W @ x + b - y) ** 2)

    dW, db = closures.reference_gradients("dense")[0]
    W, b, h = arrays["W"], arrays["b"], 1e-6
    for i in range(W.shape[1]):
        step = np.zeros_like(W)
        step[0, i] = h
        assert dW[0, i] == pytest.approx((loss(W + step, b) - loss(W - step, b)) / (2 * h), rel=1e-6, abs=1e-9)
    assert db[0, 0] == pytest.approx((loss(W, b + h) - loss(W, b - h)) / (2 * h), rel=1e-6)


def _frame(records):
    return closures.expand_cases(records_frame(records))


def _warm_counts(frame, step):
    rows = frame[(frame["step"] == step) & (frame["metric"] == "warm_alloc_count")]
    return rows["value"].tolist()


@pytest.mark.serial  # counts this process's allocations: an xdist worker's own thread would add to them
def test_benchlib_steady_state_allocations_are_equal_for_both_setups():
    frame = _frame(closures.run_protocol("dense", "benchlib-inplace", "seed", device="cpu", protocol=TINY))
    counts = {step: _warm_counts(frame, step) for step in STEPS}
    assert all(len(values) == TINY.alloc_samples for values in counts.values())
    floors = {step: min(values) for step, values in counts.items()}
    assert floors[INITIAL] > 0  # the tracker sees the engine's NumPy buffers
    assert floors[INITIAL] == floors[NEW] == floors[RESETUP] == floors[RERUN]
    verdicts = closures.verdict_table(records_frame(frame.drop(columns=["mwe", "order", "step", "engine"])))
    warm = verdicts[verdicts["phase"] == "warm"]
    assert set(warm["allocs verdict"]) == {"same"} and set(warm["bytes verdict"]) == {"same"}
    assert set(warm["python allocs verdict"]) == {"same"}
    assert warm["grads identical"].all()


@pytest.mark.serial  # counts this process's allocations: an xdist worker's own thread would add to them
def test_the_trackers_floor_is_subtracted_and_kept_in_each_counts_params():
    frame = records_frame(closures.tracker_records("cpu", samples=3))
    counts = frame[frame["metric"].isin(["alloc_count", "alloc_count_python"])]
    assert all("floor" in json.loads(params) for params in counts["params"])
    # an empty call counts nothing (the first sample may also hold its code object's first-trace line table)
    assert set(counts[counts["repeat"] > 0]["value"]) == {0.0}


def _memray_python_count_under(fn, function: str, path) -> int:
    """Independently of benchlib: memray's Python-allocator records, from a Tracker around `fn` alone,
    with `function` on their stack."""
    import memray

    python = {memray.AllocatorType.PYMALLOC_MALLOC, memray.AllocatorType.PYMALLOC_CALLOC,
              memray.AllocatorType.PYMALLOC_REALLOC}
    with memray.Tracker(path, native_traces=False, trace_python_allocators=True):
        fn()
    return sum(record.n_allocations for record in memray.FileReader(path).get_allocation_records()
               if record.allocator in python and any(frame[0] == function for frame in record.stack_trace()))


@pytest.mark.serial  # counts this process's allocations: an xdist worker's own thread would add to them
def test_a_warm_torch_closure_calls_python_count_is_memrays_count_of_that_call(tmp_path):
    problem = closures.MWE("dense", _engine("torch"))
    state = problem.setup("setup1")
    call = lambda: problem.train(state)  # noqa: E731
    for _ in range(2):  # warm, and past the first traced run of each code object
        count_allocations(call)
    ours = count_allocations(call).python_count
    independent = _memray_python_count_under(call, "train", tmp_path / "call.bin")
    assert abs(ours - independent) <= 0.05 * independent


def test_torch_compile_compiles_once_per_code_object_and_reuses_it_when_setup1_runs_again():
    frame = _frame(closures.run_protocol("reduced", "torch.compile", "reversed", device="cpu", protocol=TINY))
    compiles = frame[frame["metric"] == "cold_compiles"].set_index("step")["value"]
    recompiles = frame[frame["metric"] == "recompiles"].set_index("step")["value"]
    # reversed: setup2 builds state1, setup1 the structurally identical new one
    assert compiles.to_dict() == {INITIAL: 1, RERUN: 0, NEW: 1, RESETUP: 0}
    assert set(recompiles) == {0}
    assert set(frame[frame["metric"] == "warm_compiles"]["value"]) == {0}
    params = json.loads(frame["params"].iloc[0])
    assert params["backend"] == "eager" and params["order"] == "reversed"


def test_records_cover_every_step_and_the_tables_and_figure_read_them():
    sizes = {"warmup": 1, "repeats": 2, "cold_passes": 1, "alloc_passes": 1, "alloc_samples": 1, "backend": "eager"}
    config = closures.BENCHMARK.config({"mwes": ["reduced"], "engines": ["torch"], "orders": ["seed", "reversed"], **sizes})
    records = closures.run(config, "cpu", progress=None)
    frame = records_frame(records)
    assert set(frame["device"]) == {"cpu"}
    assert set(frame[frame["variant"] == "torch"]["dtype"]) == {"float64"}
    table = closures.seed_table(frame)
    assert len(table) == 2 * len(STEPS)
    assert list(table[table["order"] == "seed"]["setup"]) == ["setup1", "setup1", "setup2", "setup1"]
    assert list(table[table["order"] == "reversed"]["setup"]) == ["setup2", "setup2", "setup1", "setup2"]
    assert (table["warm allocs"] > 0).all() and (table["warm time (µs)"] > 0).all()
    verdicts = closures.verdict_table(frame)
    assert len(verdicts) == 2 * (len(closures.PAIRS["warm"]) + len(closures.PAIRS["cold"]))
    cold = verdicts[verdicts["phase"] == "cold"]
    assert set(cold["time verdict"]) == {"too few samples"}  # one cold pass cannot reach p < 0.01
    tracker = closures.tracker_table(frame)
    assert set(tracker["metric"]) == {"alloc_count", "alloc_bytes", "alloc_count_python"}
    # Python's allocator serves the tensor wrappers and tape nodes malloc never sees
    assert (table["warm python allocs"] > 0).all() and "python allocs verdict" in verdicts
    figure = steps_figure(table, mwe="reduced", phase="cold")
    assert len(figure.data) == 3 * 2  # system allocations, Python allocations and time, per order
    assert [figure.layout[f"yaxis{n}"].title.text for n in (1, 3, 5)] == [
        "cold allocations per train()", "cold Python allocations per train()",
        "cold time per train() (ms; bars: range over passes)"]
    # the figure tells engines apart by colour alone (torch.compile and torch.func once shared one)
    assert len({engine_color(engine) for engine in closures.VALID_ENGINES}) == len(closures.VALID_ENGINES)
    with pytest.raises(ValueError, match="mwes present"):
        steps_figure(table, mwe="dense")


def test_an_engine_that_cannot_run_on_the_device_is_recorded_as_not_applicable(monkeypatch):
    monkeypatch.setattr(closures.protocol, "not_applicable", lambda engine, device: "HIPS autograd runs on the CPU only")
    frame = records_frame(closures.run_protocol("dense", "autograd", "seed", device="cpu", protocol=TINY))
    assert set(frame["metric"]) == {closures.NOT_APPLICABLE} and len(frame) == len(STEPS)
    table = closures.seed_table(frame)
    assert set(table["not applicable"]) == {"HIPS autograd runs on the CPU only"}
    assert closures.verdict_table(frame).empty


def _synthetic(step, metric, values, unit="count"):
    return [make_record(benchmark=closures.NAME, case=closures.case_name("dense", "seed", step), engine="e",
                        device="cpu", dtype="float32", metric=metric, value=v, unit=unit, repeat=i,
                        params={"mwe": "dense", "order": "seed", "step": step})
            for i, v in enumerate(values)]


def test_verdict_table_flags_a_cursed_first_closure_and_spares_a_jittery_one():
    cursed = {INITIAL: 419, RERUN: 419, NEW: 329, RESETUP: 419}
    records = []
    for step, count in cursed.items():
        records += _synthetic(step, "warm_alloc_count", [count, count + 1, count])  # tracker jitter of 1
        records += _synthetic(step, "warm_alloc_bytes", [8 * count] * 3, "B")
        scale = 25.7e-6 if count == 419 else 19.3e-6
        records += _synthetic(step, "warm_time", list(scale * (1 + 0.01 * np.arange(10))), "s")
    verdicts = closures.verdict_table(records_frame(records)).set_index("pair")
    for pair in (f"{INITIAL} vs {NEW}", f"{RESETUP} vs {NEW}"):
        assert verdicts.loc[pair, "allocs verdict"] == "differ"
        assert verdicts.loc[pair, "time verdict"] == "differ"
        assert verdicts.loc[pair, "allocs jitter"] == 1
    assert verdicts.loc[f"{INITIAL} vs {RERUN}", "allocs verdict"] == "same"
    assert verdicts.loc[f"{INITIAL} vs {RERUN}", "time verdict"] == "same"
    assert len(closures.differing_pairs(verdicts.reset_index())) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"engines": ["jax"]}, "each one of benchlib-inplace"),
        ({"engines": "torch"}, "non-empty list"),
        ({"mwes": ["mnist"]}, "each one of dense, reduced"),
        ({"orders": ["backwards"]}, "each one of seed, reversed"),
        ({"repeats": 0}, "repeats must be an integer >= 1"),
        ({"alloc_passes": 0}, "alloc_passes must be an integer >= 1"),
        ({"backend": "xla"}, "backend must be one of inductor"),
        ({"repeat": 3}, "unknown parameter"),
        ({"alpha": 1.0}, "alpha must be between 0 and 1"),
    ],
)
def test_bad_arguments_are_refused_by_the_declaration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        closures.BENCHMARK.config(kwargs)


@pytest.mark.slow
def test_notebook_runs_with_quick_sizes_and_writes_its_records_and_figures(tmp_path):
    from benchlib.runner import run

    engines = ["benchlib-inplace", "torch"]  # every engine's protocol is tested above; this is the notebook's path
    result = run(["identical_closures"], device="cpu", out=tmp_path, quick=True, params={"engines": engines},
                 progress=False, stream=io.StringIO())
    assert result.ok, result.status_table()
    records = pd.read_parquet(result.path / "records" / "identical_closures.parquet")
    measured = records[records["dimension"] != "tracker"]
    assert set(measured["variant"]) == set(engines)
    assert set(records["device"]) == {"cpu"}
    assert {"warm_time", "cold_time", "warm_alloc_count", "cold_alloc_bytes", "grads_identical"} <= set(records["metric"])
    for phase in ("warm", "cold"):
        assert (result.path / "figures" / f"identical_closures_reduced_{phase}.html").is_file()
