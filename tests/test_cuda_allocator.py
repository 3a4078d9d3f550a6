"""The CUDA caching allocator's view beside the peak: reserved against allocated, the reserve that holds no
tensor, cudaMalloc calls and retries, and an allocator snapshot the memory visualiser reads. The records'
shape is checked everywhere; the numbers only where a GPU is present."""

import pickle

import pytest
import torch

from benchlib.measure import IsolationOptions, Measurement, run_isolated
from benchlib.measure.cuda_snapshot import snapshot_folder, snapshot_path
from benchlib.measure.devices import Device
from benchlib.records.metrics import METRICS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
VIEW = {"cuda_reserved_peak_bytes": 8_388_608, "cuda_reserved_unused_bytes": 4_388_608,
        "cuda_malloc_count": 2, "cuda_alloc_retries": 0}


def test_the_allocator_view_becomes_registered_records_and_survives_the_process_boundary():
    measurement = Measurement(name="c", device="cuda:0", times_s=(0.1,), gc_count=0, gc_seconds=0.0,
                              cuda_allocator=VIEW)
    again = Measurement.from_dict(measurement.to_dict())
    assert again.cuda_allocator == VIEW
    rows = {row["metric"]: row for row in again.records(benchmark="b", engine="e", dtype="float32")}
    assert {name: rows[name]["value"] for name in VIEW} == VIEW
    assert [rows[name]["unit"] for name in VIEW] == ["B", "B", "count", "count"]
    assert all(name in METRICS for name in VIEW)


def test_the_cpu_has_no_allocator_view_and_writes_no_snapshot(tmp_path):
    cpu = Device("cpu")
    assert cpu.allocator_counters() is None and cpu.allocator_view({}) is None
    with snapshot_folder(tmp_path):
        assert snapshot_path("model/step/torch", cpu) is None
        assert snapshot_path("model/step/torch", Device("cuda", 0)) == str(tmp_path / "model-step-torch.pickle")
    assert snapshot_path("model/step/torch", Device("cuda", 0)) is None  # outside the runner's folder: none
    with pytest.raises(ValueError, match="cuda_snapshot must be a file path"):
        IsolationOptions(cuda_snapshot="")


@needs_cuda
@pytest.mark.cuda
def test_a_growing_step_reserves_at_least_what_it_allocates_and_takes_segments(tmp_path):
    snapshot = tmp_path / "grow.pickle"
    result = run_isolated("isolation_targets:cuda_grow", {"n": 1_000_000, "count": 4}, name="grow", device="cuda",
                          options=IsolationOptions(warmup=0, cuda_snapshot=str(snapshot)))
    view = result.measurement.cuda_allocator
    allocated = 4 * (1 + 2 + 3 + 4) * 1_000_000  # float32 tensors of 1, 2, 3 and 4 million elements
    assert view["cuda_reserved_peak_bytes"] >= allocated + view["cuda_reserved_unused_bytes"] - 1
    assert view["cuda_malloc_count"] >= 1 and view["cuda_alloc_retries"] == 0
    with open(snapshot, "rb") as f:
        dumped = pickle.load(f)
    sizes = [block["size"] for segment in dumped["segments"] for block in segment["blocks"]]
    assert sum(sizes) >= allocated and dumped["device_traces"]
