"""Workload B: five LeNet5s, sequential / threads / vmap from the same start and the same batches."""

import json

import pytest
import torch

from benchlib.measure import resolve_device
from benchlib.records import records_frame
from benchlib.report.plots.ensembles import lenet_epochs
from benchlib.workloads.ensembles import lenet as L
from benchlib.zoo.mnist_data import synthetic_mnist

CPU = resolve_device("cpu")
TINY = L.LeNetConfig(n_models=3, batch=16, epochs=2, step_limit=2, seed=4)


@pytest.fixture(scope="module")
def data():
    return synthetic_mnist(160, seed=2)


def test_lenet5_has_the_mwe_layers():
    model = L.lenet5()
    assert sum(p.numel() for p in model.parameters()) == 44426
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def trainers(data):
    x, y = data.as_float_tensors()
    return {mode: cls(TINY, x.view(-1, 1, 28, 28), y, CPU.torch) for mode, cls in L.TRAINERS.items()}


def test_modes_start_equal_and_stay_together(data):
    modes = trainers(data)
    start = {mode: t.stacked_parameters() for mode, t in modes.items()}
    for mode in L.MODES:
        for name, value in start["sequential"].items():
            assert torch.equal(start[mode][name], value), (mode, name)
    batches = torch.arange(32).view(2, 16)
    for t in modes.values():
        t.run(batches)
    after = {mode: t.stacked_parameters() for mode, t in modes.items()}
    for name, value in after["sequential"].items():
        assert torch.equal(after["threads"][name], value)  # the same ops per model, only in other threads
        torch.testing.assert_close(after["vmap"][name], value, rtol=1e-4, atol=1e-5)
        assert not torch.equal(value, start["sequential"][name])


def test_run_lenet_reports_each_epoch_and_labels_the_data(data):
    printed = []
    results, labels = L.run_lenet(data, device=CPU, config=TINY, alloc_steps=1,
                                  progress=lambda mode, r: printed.append((mode, r.at_time())))
    assert [(r.mode, r.epoch) for r in results] == [(m, e) for m in L.MODES for e in range(2)]
    assert all(r.steps == 2 and r.seconds > 0 and r.alloc_bytes_est > 0 for r in results)
    assert [mode for mode, _ in printed] == [r.mode for r in results]
    assert all(" seconds (~" in line for _, line in printed)
    assert labels["data"] == "synthetic" and labels["steps_per_epoch"] == 2 and labels["alloc_source"] == "memray"
    frame = records_frame(L.lenet_records(results, labels, CPU))
    assert set(frame["case"]) == {f"lenet5|{m}" for m in L.MODES}
    assert {json.loads(p)["data"] for p in frame["params"]} == {"synthetic"}
    table = L.lenet_frame(results, labels)
    assert set(table["mode"]) == set(L.MODES) and set(table["data"]) == {"synthetic"}
    # what an "epoch" is: TINY's step_limit cuts the full pass over the data
    assert set(table["steps"]) == {2} and set(table["batch"]) == {TINY.batch}
    assert set(table["steps_per_full_pass"]) == {len(data) // TINY.batch} and len(data) // TINY.batch > 2
    figure = lenet_epochs(table, data="synthetic")
    assert figure.layout.xaxis.title.text == (f"epoch: 2 steps of {TINY.batch} samples "
                                              f"(of a full pass's {len(data) // TINY.batch}, cut by lenet_step_limit)")


def test_at_time_line_matches_the_thread_format():
    epoch = L.EpochResult("threads", 0, seconds=9.269353, gc_count=3, gc_seconds=1.35332, loss=0.1, steps=10,
                          alloc_count_est=1_460_000, alloc_bytes_est=34.171e9)
    assert epoch.at_time() == "  9.269353 seconds (~1.460 M allocations: ~34.17 GB, 14.60% gc time)"
    quiet = L.EpochResult("vmap", 0, seconds=0.5, gc_count=0, gc_seconds=0.0, loss=0.1, steps=1)
    assert quiet.at_time() == "  0.500000 seconds ()"


def test_bad_arguments_are_refused(data):
    with pytest.raises(ValueError, match="valid: sequential, threads, vmap"):
        L.run_lenet(data, device=CPU, config=TINY, modes=("processes",))
    with pytest.raises(ValueError, match="step_limit must be a non-negative integer"):
        L.LeNetConfig(step_limit=-1)
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        L.LeNetConfig(epochs=0)
