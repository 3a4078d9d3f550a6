"""Workload A: strategies agree (start, gradients, trajectory), all train, GC accounting, records."""

import gc
import math
import io
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from benchlib.measure import Device, resolve_device
from benchlib.measure.devices import heap_trim_available
from benchlib.records import make_record, records_frame
from benchlib.analysis.derived import STEP_SUMMARIES, with_step_summaries
from benchlib.workloads import ensembles as E
from benchlib.zoo.mnist_data import synthetic_mnist

CPU = resolve_device("cpu")
SMALL = E.EnsembleConfig(n_nets=4, hidden=6, batch=16, lr=1e-2, seed=3)
has_cuda = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not has_cuda, reason="needs a CUDA device; this machine has none")


@pytest.fixture(scope="module")
def data():
    return synthetic_mnist(512, seed=1)


@pytest.fixture(scope="module")
def tensors(data):
    return data.as_float_tensors()


def batch(tensors, step=0, config=SMALL):
    x, y = tensors
    idx = E.minibatch_indices(len(y), config.batch, step + 1, config.seed)[step]
    return x[idx], y[idx]


def test_the_thread_sized_net_has_4780_parameters_and_its_flop_count():
    config = E.EnsembleConfig()
    assert config.params_per_net == 4780
    assert config.flops_per_model_sample == 2 * (784 * 6 + 60) + 2 * 784 * 6 + 4 * 60
    floor = E.flop_floor(config, flop_rate=1e9)
    assert floor["flops_per_step"] == 200 * 64 * config.flops_per_model_sample
    assert floor["floor_step_s"] == pytest.approx(floor["flops_per_step"] / 1e9)


@pytest.mark.slow
def test_every_metric_of_the_flop_floor_is_declared_by_mnist_ensembles_itself():
    # in a full run the floor reads calibration's records, and the kernel registers only this benchmark
    import subprocess
    import sys

    code = ("from benchlib.workloads import ensembles as E; E.BENCHMARK.config(); "
            "print(len(E.flop_floor_records(E.flop_floor(E.EnsembleConfig(), 1e9), 'cpu', {})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr[-2000:]


@pytest.mark.parametrize("strategy", E.STRATEGIES)
def test_every_strategy_starts_from_the_same_parameters(strategy):
    init = E.initial_parameters(SMALL)
    held = E.make_strategy(strategy, init, SMALL, CPU).stacked_parameters()
    again = E.initial_parameters(SMALL)
    for name in E.PARAM_NAMES:
        assert torch.equal(held[name], init[name]) and torch.equal(init[name], again[name])


def test_minibatch_order_is_seeded_and_each_epoch_a_permutation():
    a = E.minibatch_indices(100, 10, 25, seed=5)
    assert torch.equal(a, E.minibatch_indices(100, 10, 25, seed=5))
    assert not torch.equal(a, E.minibatch_indices(100, 10, 25, seed=6))
    assert a.shape == (25, 10)
    assert sorted(a[:10].flatten().tolist()) == list(range(100))


@pytest.mark.parametrize("batched", ["batched_vmap", "batched_hand", "batched_fused"])
def test_batched_and_naive_gradients_agree(tensors, batched):
    init = E.initial_parameters(SMALL)
    x, y = batch(tensors)
    reference = E.make_strategy("naive", init, SMALL, CPU).gradients(x, y)
    grads = E.make_strategy(batched, init, SMALL, CPU).gradients(x, y)
    for name in E.PARAM_NAMES:
        assert grads[name].shape == reference[name].shape
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-6)
        assert reference[name].abs().max() > 0


def test_the_hand_written_backward_matches_autograd_to_rounding(tensors):
    init = E.initial_parameters(SMALL)
    autograd, fused = (E.make_strategy(name, init, SMALL, CPU) for name in ("batched_hand", "batched_fused"))
    for step in range(3):
        x, y = batch(tensors, step)
        reference, grads = autograd.gradients(x, y), fused.gradients(x, y)
        for name in E.PARAM_NAMES:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(fused.step(x, y), autograd.step(x, y), rtol=1e-6, atol=0)
    after, reference = fused.stacked_parameters(), autograd.stacked_parameters()
    for name in E.PARAM_NAMES:
        torch.testing.assert_close(after[name], reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.serial  # counts this process's allocations: an xdist worker's own thread would add to them
def test_a_warm_fused_step_allocates_no_buffer_and_leaves_no_python_object(tensors):
    from benchlib.measure import count_allocations

    x_all, y_all = tensors
    allocated = {}
    for size in (16, 64):
        config = E.EnsembleConfig(n_nets=50, batch=size, seed=3)
        fused = E.make_strategy("batched_fused", E.initial_parameters(config), config, CPU)
        x, y = x_all[:size], y_all[:size]
        for _ in range(3):  # Adam's state, made in the first step
            fused.step(x, y)
        gc.collect()
        gc.disable()
        try:
            fused.step(x, y)  # refills the free lists the collection emptied (those count as allocations)
            young = gc.get_count()[0]
            for _ in range(5):
                fused.step(x, y)
            assert gc.get_count()[0] == young  # nothing for the collector to walk, ever
        finally:
            gc.enable()
        allocated[size] = count_allocations(lambda: fused.step(x, y), CPU).bytes
    # bookkeeping only (BLAS batch pointers, shapes): less than its smallest batch-sized buffer
    # (the logits, 50 x 10 x batch floats), and nothing that grows with the batch
    assert allocated[16] < 50 * 10 * 16 * 4 and allocated[64] - allocated[16] < 50 * 10 * 48 * 4, allocated


def assert_same_parameters(params, reference, held_out, rtol=1e-4, atol=1e-5):
    """Adam divides by the gradient's own size: a weight whose gradient cancels to ~1e-9 (rounding
    noise, which differs between kernels) still takes a step of up to lr, in a direction the noise
    picks. So a few such weights may differ; all others, and the losses, must agree."""
    for param in E.PARAM_NAMES:
        close = torch.isclose(params[param], reference[param], rtol=rtol, atol=atol)
        assert close.float().mean() > 0.999, (param, int((~close).sum()))
    torch.testing.assert_close(E.evaluate(params, *held_out), E.evaluate(reference, *held_out), rtol=rtol, atol=atol)


def test_all_strategies_follow_the_same_trajectory(tensors):
    init = E.initial_parameters(SMALL)
    after = {}
    for name in E.STRATEGIES:
        strategy = E.make_strategy(name, init, SMALL, CPU)
        for step in range(3):
            strategy.step(*batch(tensors, step))
        after[name] = strategy.stacked_parameters()
        strategy.close()
    held_out = tensors[0][-128:], tensors[1][-128:]
    for name in E.STRATEGIES:
        assert_same_parameters(after[name], after["naive"], held_out)
        for param in E.PARAM_NAMES:
            assert not torch.equal(after[name][param], init[param])


@pytest.mark.parametrize("strategy", E.STRATEGIES)
def test_every_strategy_lowers_the_loss(tensors, strategy):
    x_all, y_all = tensors
    trainer = E.make_strategy(strategy, E.initial_parameters(SMALL), SMALL, CPU)
    batches = E.minibatch_indices(len(y_all) - 128, SMALL.batch, 40, SMALL.seed)
    held_out = x_all[-128:], y_all[-128:]
    before = E.evaluate(trainer.stacked_parameters(), *held_out)
    for idx in batches:
        trainer.step(x_all[idx], y_all[idx])
    after = E.evaluate(trainer.stacked_parameters(), *held_out)
    assert before.shape == (SMALL.n_nets,)
    assert (after < 0.8 * before).all(), (before, after)


def run_train(tensors, policy, steps=6, alloc_steps=1, strategy="batched_hand", config=SMALL, cycles=0,
              count_tracked=False):
    x_all, y_all = tensors
    batches = E.minibatch_indices(len(y_all), config.batch, steps + alloc_steps, config.seed)
    trainer = E.make_strategy(strategy, E.initial_parameters(config), config, CPU)
    labels = {"n_nets": config.n_nets, "batch": config.batch, "gc_policy": policy.name, "heap_objects": 0,
              "data": "synthetic"}
    plan = E.TrainingPlan(warmup=1, alloc_steps=alloc_steps, cycles=cycles, count_tracked=count_tracked)
    return E.train(trainer, x_all, y_all, batches, device=CPU, policy=policy, plan=plan, labels=labels)


def test_gc_accounting_sees_the_forced_collections(tensors):
    result = run_train(tensors, E.GCPolicy("manual", every=2, generation=2))
    forced = [i for i in range(len(result.step_s)) if (i + 1) % 2 == 0]
    for step in forced:
        assert result.gc_count[step] >= 1 and 2 in result.gc_generations[step]
        assert result.gc_s[step] > 0
    assert result.statistics()["gc_pauses"] >= len([s for s in forced if s >= 1])
    assert gc.isenabled()


def test_policies_restore_the_collector():
    was = gc.isenabled()
    with E.GCPolicy("freeze"):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and gc.isenabled() == was
    with E.GCPolicy("manual", every=3):
        assert not gc.isenabled()
    assert gc.isenabled() == was
    thresholds = gc.get_threshold()
    with E.GCPolicy("thresholds") as policy:
        assert gc.get_threshold() == E.RAISED_THRESHOLDS
        assert policy.describe() == {"gc_policy": "thresholds", "gc_thresholds": list(E.RAISED_THRESHOLDS)}
    assert gc.get_threshold() == thresholds


def test_a_kept_exception_is_a_cycle_only_the_collector_frees():
    import weakref

    gc.collect()
    gc.disable()
    try:
        error = E.check_step(torch.zeros(4, 3), torch.zeros(2))
        frame = error.__traceback__.tb_frame
        assert frame.f_locals["error"] is error  # frame -> error -> traceback -> frame
        alive = weakref.ref(error)
        del error, frame
        assert alive() is not None  # reference counting alone leaves it
        gc.collect()
        assert alive() is None
    finally:
        gc.enable()


def test_step_cycles_hold_exactly_their_tensors_until_a_collection():
    size = 16 * 784 * 4
    gc.collect()
    gc.disable()
    try:
        cycles = E.StepCycles(3)
        cycles.leave(torch.zeros(16, 784), torch.zeros(4))  # a new batch each step, as a training loop has
        # 3 standardised copies, and the batch itself: the check's frame keeps its callers' frames
        assert (cycles.held_tensors, cycles.held_bytes) == (4, 4 * size)
        cycles.leave(torch.zeros(16, 784), torch.zeros(4))  # the first step's failures are dropped: garbage, still held
        assert (cycles.held_tensors, cycles.held_bytes) == (8, 8 * size)
        cycles.close()
        assert cycles.held_tensors == 8
        assert gc.collect() >= 6 * 4  # each cycle: exception, traceback, frame, tensor at least
        assert (cycles.held_tensors, cycles.held_bytes) == (0, 0)
    finally:
        gc.enable()
    quiet = E.StepCycles(0)
    quiet.leave(torch.zeros(16, 784), torch.zeros(4))
    assert quiet.held_tensors == 0
    with pytest.raises(ValueError, match="integer >= 0"):
        E.StepCycles(-1)


def test_train_records_every_collection_and_what_the_cycles_hold(tensors):
    # manual: the collector is off but for the explicit full collection every 2nd step, so the
    # held bytes and the pauses are exact: 3 cycles of a 16x784 float32 batch copy each step, and
    # the step's batch they keep through its frame; the previous step's become garbage, and a
    # collection frees those
    result = run_train(tensors, E.GCPolicy("manual", every=2), steps=6, alloc_steps=0, cycles=3, count_tracked=True)
    per_cycle = SMALL.batch * 784 * 4
    assert (result.cycle_bytes / per_cycle).tolist() == [4, 4, 8, 4, 8, 4]
    pauses = result.pauses
    assert pauses["step"].tolist() == [1, 3, 5] and set(pauses["generation"]) == {2}
    assert (pauses["collected"] >= 3 * 4).all() and (pauses["uncollectable"] == 0).all()
    assert (pauses["tracked_before"] > pauses["collected"]).all()
    frame = records_frame(result.records(CPU))
    for metric, column in (("gc_pause_step", "step"), ("gc_pause_tracked", "tracked_before"),
                           ("gc_pause_collected", "collected"), ("gc_pause_generation", "generation")):
        rows = frame[frame["metric"] == metric].sort_values("repeat")
        assert rows["value"].tolist() == pauses[column].astype(float).tolist() and rows["repeat"].tolist() == [0, 1, 2]
    assert frame.loc[frame["metric"] == "step_cycle_bytes", "value"].tolist() == result.cycle_bytes.tolist()
    assert len(frame[frame["metric"] == "step_memory"]) == 6
    assert result.case().endswith("|cycles=3") and result.labels["cycles"] == 3
    # uncounted (the main grid's default): the pauses are there, the objects they walked are not recorded
    uncounted = run_train(tensors, E.GCPolicy("manual", every=2), steps=4, alloc_steps=0)
    assert uncounted.pauses["step"].tolist() == [1, 3] and (uncounted.pauses["tracked_before"] == -1).all()
    metrics = set(records_frame(uncounted.records(CPU))["metric"])
    assert "gc_pause_time" in metrics and "gc_pause_tracked" not in metrics
    summary = result.statistics()
    assert summary["cycle_bytes_max"] == 8 * per_cycle  # after warm-up (step 0)
    assert gc.isenabled()


def test_the_long_lived_heap_stays_tracked(data):
    with E.long_lived_heap(data, 40) as heap:
        gc.collect()
        assert len(heap) == 40 and all(gc.is_tracked(sample) for sample in heap)


@pytest.mark.serial  # counts this process's allocations: an xdist worker's own thread would add to them
def test_train_counts_allocations_in_a_separate_pass_and_records_tidy_rows(tensors):
    result = run_train(tensors, E.GCPolicy("default"), steps=5, alloc_steps=2)
    assert len(result.step_s) == 5 and (result.step_s > 0).all()
    assert result.alloc_source == "memray" and result.alloc_count_per_step > 0 and result.alloc_bytes_per_step > 0
    assert result.alloc_count_python_per_step > 0 and result.alloc_bytes_python_per_step > 0
    rows = result.records(CPU)
    frame = records_frame(rows)
    per_step = frame[frame["metric"] == "step_time"]
    assert per_step["repeat"].tolist() == list(range(5))
    # what was measured is stored; the summaries are derived from the steps, equal to the in-memory ones
    frame = frame[~frame["metric"].str.startswith("gc_pause_")]  # one row per collection, if any ran
    assert set(frame["metric"]) == {"alloc_count_per_step", "alloc_bytes_per_step", "alloc_count_python_per_step",
                                    "alloc_bytes_python_per_step", "peak_bytes", "step_time",
                                    "step_gc_pauses", "step_gc_time", "step_loss", "step_memory"}
    assert len(frame) == 5 + 5 * 5
    derived = with_step_summaries(frame).set_index("metric")["value"]
    summary = result.statistics()
    shared = set(STEP_SUMMARIES) & set(summary)
    assert shared == set(STEP_SUMMARIES) - {"cycle_bytes_max"}  # no cycles left, none held
    assert {metric: derived[metric] for metric in shared} == pytest.approx({metric: summary[metric] for metric in shared})
    # an older run's stored summary of the same cell is replaced, never doubled
    stored = records_frame(rows + [make_record(metric="throughput", value=1.0, unit="model-samples/s", benchmark=E.NAME,
                                               case=rows[0]["case"], strategy="batched_hand", device=CPU, dtype="float32",
                                               params=json.loads(rows[0]["params"]))])
    throughput = with_step_summaries(stored).query("metric == 'throughput'")["value"]
    assert throughput.tolist() == pytest.approx([summary["throughput"]])
    assert {json.loads(p)["data"] for p in frame["params"]} == {"synthetic"}
    assert frame["case"].unique().tolist() == [f"batched_hand|gc=default|heap=0|threads={torch.get_num_threads()}"]


@pytest.mark.skipif(not heap_trim_available(), reason="the C library has no malloc_trim (not glibc)")
def test_each_cell_sees_its_own_peak_memory_not_what_earlier_cells_freed(tensors):
    # 200 nets: Adam's two state tensors, created in the first step, are 7.6 MB. Without handing
    # freed heap back first, the second cell reused the first cell's memory and read ~0.
    config = E.EnsembleConfig(n_nets=200, batch=16, seed=3)
    adam_state_bytes = 2 * config.n_nets * config.params_per_net * 4
    for _ in range(2):
        result = run_train(tensors, E.GCPolicy("default"), steps=3, alloc_steps=0, config=config)
        assert result.labels["peak_after_malloc_trim"] is True
        assert result.peak_bytes >= adam_state_bytes, (result.peak_bytes, adam_state_bytes)


@pytest.mark.serial  # compares this process's allocation counts of two cells: an xdist worker's thread adds to one
def test_run_grid_labels_every_record_with_the_synthetic_data_source(data):
    seen = []
    results = E.run_grid(data, device=CPU, config=SMALL,
                         grid=E.Grid(strategies=("naive", "batched_vmap"), gc_policies=("default", "freeze"),
                                     heap_sizes=(20,)),
                         plan=E.TrainingPlan(steps=4, warmup=1, alloc_steps=1), progress=seen.append)
    assert [(r.strategy, r.labels["gc_policy"], r.labels["heap_objects"]) for r in results] == [
        (s, p, 20) for p in ("default", "freeze") for s in ("naive", "batched_vmap")]
    assert seen == results
    frame = records_frame([row for r in results for row in r.records(CPU)])
    params = [json.loads(p) for p in frame["params"]]
    assert {p["data"] for p in params} == {"synthetic"} and {p["device"] for p in params} == {"cpu"}
    assert set(E.summary_frame(results)["data"]) == {"synthetic"}
    steps = E.steps_frame(results)
    assert len(steps) == 4 * 4 and set(steps["data"]) == {"synthetic"}
    # same start and same batches: per-net and batched losses coincide step by step
    naive = steps[(steps.strategy == "naive") & (steps.gc_policy == "default")]
    vmapped = steps[(steps.strategy == "batched_vmap") & (steps.gc_policy == "default")]
    np.testing.assert_allclose(naive["loss"].to_numpy(), vmapped["loss"].to_numpy(), rtol=1e-4)
    # torch makes one more allocation per operator call once vmap has run in the process; the
    # grid uses it before the first cell, so naive counts the same before and after batched_vmap
    # (without that: 44 more per net in the second naive cell; the first cell has ~24 one-off extras)
    naive_counts = [r.alloc_count_per_step for r in results if r.strategy == "naive"]
    assert abs(naive_counts[0] - naive_counts[1]) < 10 * SMALL.n_nets, naive_counts


def test_a_spent_deadline_keeps_the_first_round_and_lists_the_cells_it_could_not_afford_as_not_run(data):
    import time

    from benchlib.trials.stopping import Deadline

    grid = E.Grid(strategies=("naive", "batched_vmap"), gc_policies=("default", "freeze"), heap_sizes=(0,))
    plan = E.TrainingPlan(steps=3, warmup=1, alloc_steps=0, trials=3)
    results = E.run_grid(data, device=CPU, config=SMALL, grid=grid, plan=plan, deadline=Deadline(time.time() - 1))
    skipped = results.not_run
    # the first group's first round always runs (some answer); the next group's would only overrun the budget
    assert sorted((r.labels["gc_policy"], r.strategy, r.labels["trial"]) for r in results) == [
        ("default", "batched_vmap", 0), ("default", "naive", 0)]
    assert sorted(skipped) == [("batched_vmap", "freeze", 0), ("naive", "freeze", 0)]
    stops = {(row["case"], row["variant"]): (row["value"], json.loads(row["params"])["stop"])
             for row in E.trials_run_records(results, plan.trials, CPU)}
    assert len(stops) == 2 and set(stops.values()) == {(1.0, "budget")}
    rows = E.not_run_records(skipped, CPU, {"data": "synthetic"})
    assert [row["metric"] for row in rows] == ["not_run", "not_run"]
    assert {row["case"].split("|")[1] for row in rows} == {"gc=freeze"} and "budget" in json.loads(rows[0]["params"])["message"]
    full = E.run_grid(data, device=CPU, config=SMALL, grid=grid, plan=replace(plan, trials=2))
    assert {json.loads(row["params"])["stop"] for row in E.trials_run_records(full, 2, CPU)} == {"max_trials"}


@pytest.mark.parametrize("grid, plan, message", [
    (E.Grid(strategies=("fast",)), E.TrainingPlan(), "valid: naive"),
    (E.Grid(gc_policies=("never",)), E.TrainingPlan(), "valid: default, freeze, thresholds, manual"),
    (E.Grid(heap_sizes=(-1,)), E.TrainingPlan(), "heap sizes must be integers >= 0"),
    (E.Grid(), E.TrainingPlan(steps=3, warmup=3), "steps must exceed warmup"),
    (E.Grid(), E.TrainingPlan(steps_per_strategy={"slow": 3}), "unknown strategies"),
])
def test_run_grid_refuses_bad_arguments_before_work(data, grid, plan, message):
    with pytest.raises(ValueError, match=message):
        E.run_grid(data, device=CPU, config=SMALL, grid=grid, plan=plan)


def test_bad_config_and_policy_are_refused():
    with pytest.raises(ValueError, match="n_nets must be a positive integer"):
        E.EnsembleConfig(n_nets=0)
    with pytest.raises(ValueError, match="valid: default, freeze, thresholds, manual"):
        E.GCPolicy("sometimes")
    with pytest.raises(ValueError, match="generation must be 0, 1 or 2"):
        E.GCPolicy("manual", generation=3)


def test_flop_rate_is_read_from_calibration_records_of_the_same_device_and_thread_count():

    def row(value, device="cpu", dtype="float32", engine="torch", n=512, threads=2):
        return make_record(benchmark="calibration", case="matmul", engine=engine, device=device, dtype=dtype,
                           metric="flop_rate", value=value, unit="FLOP/s", params={"n": n, "torch_threads": threads})

    frame = records_frame([row(1e9), row(3e9), row(2e9, n=1024), row(9e9, device="cuda:0"), row(8e9, dtype="float64"),
                           row(7e9, engine="numpy"), row(6e9, threads=4)])
    assert E.calibration_flop_rate(frame, "cpu", threads=2) == 2e9  # best median over sizes: 512 -> 2e9, 1024 -> 2e9
    assert E.calibration_flop_rate(frame, "cpu") == 6e9  # any thread count
    assert E.calibration_flop_rate(frame, "cpu", threads=1) is None
    assert E.calibration_flop_rate(frame, "cuda:1") is None
    assert E.calibration_flop_rate(pd.DataFrame(), "cpu") is None


@pytest.mark.serial  # it counts the objects a collection walks in this process: an xdist worker's thread adds some
def test_full_collection_pauses_cover_each_heap_frozen_and_not(data):
    pauses = E.full_collection_pauses(data, heap_sizes=(0, 50), repeats=2)
    assert pauses[["heap_objects", "frozen", "repeat"]].values.tolist() == [
        [h, f, r] for h in (0, 50) for f in (False, True) for r in (0, 1)]
    assert set(pauses["generation"]) == {2} and gc.get_freeze_count() == 0
    rows = records_frame(E.collection_pause_records(pauses, CPU, {"data": data.source}))
    # one row per pause and quantity (time, generation, collected, uncollectable, tracked), one case per heap and state
    assert len(rows) == 8 * 5 and set(rows["variant"]) == {"python-gc"} and set(rows["dimension"]) == {"collector"}
    assert rows["case"].nunique() == 4 and sorted(rows["repeat"].unique()) == [0, 1]
    # the heap adds 50 tuples and 50 tensors to what a collection walks; freezing hides them all
    walked = pauses.groupby(["heap_objects", "frozen"])["tracked_before"].min()
    assert walked[(50, False)] - walked[(0, False)] >= 100 and walked[(50, True)] < walked[(0, False)]


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("strategy", E.STRATEGIES)
def test_strategies_on_cuda_match_the_cpu_trajectory(tensors, strategy):
    init = E.initial_parameters(SMALL)
    cuda = Device("cuda", 0)
    on_cpu = E.make_strategy(strategy, init, SMALL, CPU)
    on_gpu = E.make_strategy(strategy, init, SMALL, cuda)
    for step in range(2):
        x, y = batch(tensors, step)
        on_cpu.step(x, y)
        on_gpu.step(x.cuda(), y.cuda())
    assert_same_parameters(on_gpu.stacked_parameters(), on_cpu.stacked_parameters(),
                           (tensors[0][-128:], tensors[1][-128:]), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_notebook_runs_through_the_runner_with_quick_sizes(tmp_path):
    from benchlib.runner import run

    empty = tmp_path / "no-mnist"
    empty.mkdir()
    result = run(["mnist_ensembles"], device="cpu", out=tmp_path / "runs", quick=True, progress=False,
                 stream=io.StringIO(), params={"data_dir": str(empty), "download": False})
    assert result.ok, result.status_table()
    records = pd.read_parquet(result.path / "records" / "mnist_ensembles.parquet")
    params = [json.loads(p) for p in records["params"]]
    assert {p["data"] for p in params} == {"synthetic"}
    assert set(records["variant"]) >= set(E.STRATEGIES) | {"sequential", "threads", "vmap", "flop_floor", "python-gc"}
    assert not records["metric"].isin(STEP_SUMMARIES).any()  # derived when read, never stored
    derived = with_step_summaries(records)
    summary = derived[derived["metric"] == "throughput"]
    # QUICK runs 2 trials of every cell (every strategy under the default policy, the 2 policy_strategies under
    # the other 3), + the thread sweep's one cell (QUICK: [1]), + the GC experiment's 2 trials of 2 strategies x
    # every policy x 2 cycle counts (QUICK: [0, 5])
    cells = len(E.STRATEGIES) + 2 * (len(E.GC_POLICIES) - 1)
    assert len(summary) == 2 * cells + 1 + 2 * 2 * len(E.GC_POLICIES) * 2
    assert summary["case"].str.contains("cycles=5\\|sweep=cycles").sum() == 2 * 2 * len(E.GC_POLICIES)
    trial_of = summary["params"].map(lambda p: json.loads(p)["trial"])
    threads_case = summary["case"].str.endswith("sweep=threads")
    assert (trial_of[~threads_case].groupby(summary["case"]).nunique() == 2).all()
    pauses = records[records["metric"] == "gc_pause_tracked"]
    assert len(pauses) and (pauses["value"] > 0).all()  # every collection with the objects it walked
    positions = summary["params"].map(lambda p: json.loads(p)["position"])
    assert sorted(positions[~summary["case"].str.contains("sweep")].unique()) == list(range(2 * len(E.STRATEGIES)))
    assert summary["case"].str.endswith("|threads=1|sweep=threads").sum() == 1
    for figure in ("trace_default", "trace_freeze", "trace_thresholds", "trace_manual", "step_time_distribution",
                   "throughput", "loss", "cycles_naive", "cycles_batched_hand", "gc_pauses", "lenet"):
        html = (result.path / "figures" / f"mnist_ensembles_{figure}.html").read_text()
        assert "data=synthetic" in html
    executed = json.loads((result.path / "notebooks" / "mnist_ensembles.ipynb").read_text())
    shown = [json.dumps(output) for cell in executed["cells"] for output in cell.get("outputs", [])]
    assert any("SYNTHETIC MNIST-shaped dataset" in text for text in shown)  # the fallback warning is in the output


def test_thread_sweep_runs_the_cell_at_each_thread_count_and_restores_torch(data):
    before = torch.get_num_threads()
    plan = E.TrainingPlan(steps=4, warmup=1)
    results = E.thread_sweep(data, device=CPU, config=SMALL, thread_counts=[1, 2], plan=plan)
    assert [r.labels["torch_threads"] for r in results] == [1, 2]
    assert len({r.case() for r in results}) == 2
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="thread_counts"):
        E.thread_sweep(data, device=CPU, config=SMALL, thread_counts=[0], plan=plan)


def test_cycle_sweep_runs_each_policy_at_each_cycle_count(data):
    grid = E.Grid(strategies=("batched_hand",), gc_policies=("default", "manual"), heap_sizes=(10,))
    results = E.cycle_sweep(data, device=CPU, config=SMALL, cycle_counts=[0, 2], grid=grid,
                            plan=E.TrainingPlan(steps=4, warmup=1, manual_every=2, trials=2))
    # trials alternate the order of the cycle counts, so drift falls on both alike
    assert [(r.labels["trial"], r.labels["cycles"], r.labels["gc_policy"]) for r in results] == [
        (t, c, p) for t, counts in ((0, (0, 2)), (1, (2, 0))) for c in counts for p in ("default", "manual")]
    assert {r.labels["trials"] for r in results} == {2}
    results = [r for r in results if r.labels["trial"] == 0]
    assert {r.labels["sweep"] for r in results} == {"cycles"} and {r.labels["heap_objects"] for r in results} == {10}
    assert len({r.case() for r in results}) == 4
    assert all(r.alloc_count_per_step != r.alloc_count_per_step for r in results)  # no allocation pass (NaN)
    pauses = E.pauses_frame(results)
    manual = pauses[pauses["gc_policy"] == "manual"]
    assert set(manual["generation"]) == {2} and (manual["tracked_before"] > 0).all()  # the experiment counts them
    assert (E.summary_frame(results)["cycles"] == [0, 0, 2, 2]).all()
    with pytest.raises(ValueError, match="cycle_counts"):
        E.cycle_sweep(data, device=CPU, config=SMALL, cycle_counts=[-1])


def _synthetic_gc_experiment():
    """Summary and pause frames as `cycle_sweep` makes them: batched_hand under two policies, 0 or 4
    cycles, two trials; p99 doubles with cycles under manual, the pauses lie on 3e-7 s per object."""
    rows, pauses = [], []
    for policy in ("default", "manual"):
        for cycles in (0, 4):
            for trial in (0, 1):
                p99 = 0.004 * (2 if policy == "manual" and cycles else 1) * (1 + 0.01 * trial)
                rows.append({"strategy": "batched_hand", "gc_policy": policy, "heap_objects": 60, "torch_threads": 1,
                             "cycles": cycles, "data": "synthetic", "trial": trial, "step_time_median": 0.002,
                             "step_time_p99": p99, "step_time_max": 2 * p99, "gc_share": 0.1, "throughput": 1.0,
                             "alloc_bytes_per_step": float("nan"), "peak_bytes": 1e6, "step_memory_max": 2e6,
                             "cycle_bytes_max": 1e6 * cycles})
                if policy == "manual":
                    for tracked in (4e5, 5e5):
                        pauses.append({"step": 9, "generation": 2, "pause_s": 3e-7 * tracked, "collected": 7 * cycles,
                                       "uncollectable": 0, "tracked_before": tracked, "strategy": "batched_hand",
                                       "gc_policy": policy, "heap_objects": 60, "cycles": cycles, "trial": trial,
                                       "data": "synthetic", "warmup": 1})
                pauses.append({"step": 3, "generation": 0, "pause_s": 1e-4, "collected": 5, "uncollectable": 0,
                               "tracked_before": 700, "strategy": "batched_hand", "gc_policy": policy,
                               "heap_objects": 60, "cycles": cycles, "trial": trial, "data": "synthetic",
                               "warmup": 1})
    return pd.DataFrame(rows), pd.DataFrame(pauses)


def test_cycles_table_counts_collections_per_generation_and_rates_p99_against_no_cycles():
    from benchlib.report.tables.ensembles import cycles_table

    summary, pauses = _synthetic_gc_experiment()
    in_warmup = pauses.iloc[:1].assign(step=0, generation=1)  # left out, as the step statistics leave warm-up out
    table = cycles_table(summary, pd.concat([pauses, in_warmup])).set_index(["gc_policy", "cycles"])
    assert (table["gen1"] == 0).all()
    assert table.loc[("manual", 4), "gen2"] == 2 and table.loc[("manual", 4), "gen0"] == 1  # per trial
    assert table.loc[("default", 4), "gen2"] == 0 and table.loc[("default", 0), "trials"] == 2
    assert table.loc[("manual", 4), "p99_vs_no_cycles"] == pytest.approx(2.0)
    assert table.loc[("default", 4), "p99_vs_no_cycles"] == pytest.approx(1.0)
    assert math.isnan(table.loc[("manual", 0), "p99_vs_no_cycles"])
    assert table.loc[("manual", 0), "held_MB"] == 0 and table.loc[("manual", 4), "held_MB"] == 4 and table.loc[("manual", 4), "longest_pause_ms"] == pytest.approx(150)


def test_the_full_collection_fit_leaves_out_young_and_frozen_pauses_and_the_figure_draws_it():
    from benchlib.report.plots.ensembles import cycle_traces, pauses_vs_tracked
    from benchlib.report.tables.ensembles import full_collection_fit, pause_slope_text

    _, pauses = _synthetic_gc_experiment()
    experiment = pd.DataFrame({"repeat": [0, 0, 0, 0, 0], "generation": [2, 2, 2, 2, 0], "collected": 0,
                               "uncollectable": 0, "tracked_before": [3e5, 6, 4.5e5, 6e5, 500],
                               "pause_s": [0.09, 5.0, 0.135, 0.18, 7.0], "heap_objects": [0, 0, 30, 60, 60],
                               "frozen": [False, True, False, False, False], "data": "synthetic"})
    fit = full_collection_fit(experiment)  # the frozen one (5 s over 6 objects) and the young one left out
    assert fit.slope == pytest.approx(3e-7) and fit.intercept == pytest.approx(0, abs=1e-9)
    assert (fit.n, fit.x_low, fit.x_high) == (3, 3e5, 6e5)
    assert "30.00 ms per 100,000 tracked objects [30.00, 30.00]" in pause_slope_text(fit)
    assert full_collection_fit(experiment.iloc[:2]) is None and "too few" in pause_slope_text(None)
    close = experiment.assign(tracked_before=[4.03e5, 6, 4.05e5, 4.07e5, 500])  # quick sizes: heaps within 1%
    assert full_collection_fit(close) is None
    pauses = pd.concat([pauses, pauses.iloc[:1].assign(tracked_before=-1, generation=1)])  # one not counted
    figure = pauses_vs_tracked(pauses, experiment, fit=fit, device="cpu")
    names = [trace.name for trace in figure.data]
    assert "training step, generation 2" in names and "gc.collect() after gc.freeze()" in names
    assert "training step, generation 1" not in names  # the uncounted pause is left out
    assert any(name.startswith("fit through gc.collect() over the heaps: 30.00 ms per 100k objects") for name in names)
    assert "data=synthetic" in figure.layout.title.text
    steps = pd.DataFrame({"strategy": "batched_hand", "gc_policy": "manual", "heap_objects": 60, "trial": 0,
                          "cycles": 4, "data": "synthetic", "step": range(4), "step_s": [0.002, 0.1, 0.002, 0.002],
                          "gc_count": [0, 1, 0, 0], "gc_s": [0, 0.098, 0, 0], "gc_generations": ["", "2", "", ""],
                          "cycle_bytes": [4e6, 4e6, 8e6, 4e6]})
    traces = cycle_traces(steps, strategy="batched_hand", device="cpu")
    assert "4 reference cycles per step" in traces.layout.title.text
    assert list(traces.data[2].y) == [4, 4, 8, 4]  # MB held, per step
    with pytest.raises(ValueError, match="no GC-experiment steps for strategy 'naive'"):
        cycle_traces(steps, strategy="naive")


def test_the_headline_table_gives_each_batched_strategy_its_gain_floor_factor_and_spread():
    from benchlib.report.tables.ensembles import batched_gain

    rows = [{"data": "synthetic", "gc_policy": "default", "heap_objects": 0, "strategy": strategy, "trial": trial,
             "throughput": throughput * (1 + 0.01 * trial), "step_time_median": 0.002, "step_time_p99": 0.002 * spread}
            for strategy, throughput, spread in (("naive", 1e5, 1.1), ("batched_hand", 2e6, 1.9),
                                                 ("batched_fused", 5e6, 1.2))
            for trial in range(3)]
    table = batched_gain(pd.DataFrame(rows), ceiling=1e7).set_index("strategy")
    assert table.index.tolist() == ["batched_hand", "batched_fused"]  # no batched_vmap trials, no row
    assert table.loc["batched_fused", "gain_over_naive"] == pytest.approx(50)
    assert table.loc["batched_fused", "below_floor"] == pytest.approx(1e7 / 5.05e6, abs=0.01)
    assert table.loc["batched_fused", "below_floor_low"] <= table.loc["batched_fused", "below_floor"]
    assert table.loc["batched_hand", "p99_over_median"] == pytest.approx(1.9)
    assert table.loc["batched_fused", "throughput"] == pytest.approx(5.05e6)
    assert "below_floor" not in batched_gain(pd.DataFrame(rows)).columns


def test_a_policy_other_than_the_default_runs_only_the_strategies_crossed_with_every_policy(data):
    grid = E.Grid(strategies=("naive", "batched_vmap", "batched_hand"), gc_policies=("default", "manual"),
                  heap_sizes=(0,), policy_strategies=("naive", "batched_hand"))
    results = E.run_grid(data, device=CPU, config=SMALL, grid=grid, plan=E.TrainingPlan(steps=3, warmup=1, alloc_steps=0,
                                                                                         trials=1))
    assert sorted((r.labels["gc_policy"], r.strategy) for r in results) == [
        ("default", "batched_hand"), ("default", "batched_vmap"), ("default", "naive"),
        ("manual", "batched_hand"), ("manual", "naive")]


def test_strategies_left_to_the_default_policy_are_refused_when_the_default_policy_is_not_run():
    with pytest.raises(ValueError, match="run under the default GC policy only, which gc_policies leaves out"):
        E.BENCHMARK.config({"gc_policies": ["manual"]})
    assert E.BENCHMARK.config({"gc_policies": ["manual"], "policy_strategies": list(E.STRATEGIES)})


def test_a_spent_budget_leaves_the_later_phases_not_run_said_recorded_and_their_figures_out(data, monkeypatch):
    import time

    from benchlib.registry import get
    from benchlib.report.plots.ensembles import pauses_vs_tracked
    from benchlib.report.tables.ensembles import closing_text
    from benchlib.trials.stopping import DEADLINE_ENV
    from benchlib.workloads.ensembles.study import run_study

    declaration = get("mnist_ensembles")
    config = declaration.config({**declaration.quick, "strategies": ["naive"], "gc_policies": ["default"],
                                 "policy_strategies": ["naive"], "heap_sizes": [0], "trials": 1, "steps": 3,
                                 "per_net_steps": 3, "warmup": 1})
    monkeypatch.setenv(DEADLINE_ENV, repr(time.time() - 1))  # the notebook's --budget already spent
    said = []
    study = run_study(config, data, device=CPU, progress=said.append)
    assert study.summary is not None and len(study.summary) == 1  # the main grid's first cell always runs
    assert list(study.not_run) == ["gc.collect", "lenet5", "threads", "cycles"]
    assert study.pauses is None and study.lenet is None and study.threads is None and study.cycles is None
    not_run = [row for row in study.records if row["metric"] == "not_run"]
    assert {row["case"] for row in not_run} == {"gc.collect", "lenet5", "threads", "cycles"}
    assert sum(line.endswith("the run's time limit (benchlib run --budget or --timeout) ran out before it started")
               for line in said) == 4
    text = closing_text(study.summary, study.threads, floor_step_s=study.floor["floor_step_s"], device="cpu")
    assert "best cell: naive" in text and "torch thread(s)" not in text
    pauses = pd.DataFrame({"repeat": [0], "generation": [2], "collected": 0, "uncollectable": 0, "tracked_before": [300],
                           "pause_s": [0.01], "heap_objects": [0], "frozen": [False], "data": "synthetic"})
    assert pauses_vs_tracked(None, pauses, device="cpu").data  # the heap experiment drawn without the GC experiment's
