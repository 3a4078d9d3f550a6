"""The calibration workload, its figures and its notebook (tiny sizes: bookkeeping, not speed)."""
import json
import statistics

import nbformat
import pytest
import torch

from benchlib.records import records_frame
from benchlib.report.plots import calibration as plots
from benchlib.workloads import calibration

# Counts this process's own allocations and threads: an xdist worker's own thread would add to them.
pytestmark = pytest.mark.serial

NOTEBOOK = "notebooks/calibration.ipynb"


def by_metric(records, metric):
    return [r for r in records if r["metric"] == metric]


def test_matmul_flop_rate_is_flops_over_each_repeat_time():
    records = calibration.matmul_flops("cpu", sizes=[8, 16], dtypes=["float64"], repeats=2)
    times, rates = by_metric(records, "time"), by_metric(records, "flop_rate")
    assert len(rates) == len(times) == 2 * 2 * 2  # libraries x sizes x repeats
    for time_row, rate_row in zip(times, rates):
        n = json.loads(rate_row["params"])["n"]
        assert rate_row["value"] == pytest.approx(2 * n**3 / time_row["value"], rel=1e-12)
        assert (rate_row["unit"], rate_row["dtype"], rate_row["device"]) == ("FLOP/s", "float64", "cpu")
    assert {r["variant"] for r in rates} == {"numpy", "torch"}
    assert all(json.loads(r["params"])["flop_per_call"] == 2 * json.loads(r["params"])["n"] ** 3
               for r in rates)


def test_copy_bandwidth_counts_bytes_read_and_written():
    records = calibration.copy_bandwidth("cpu", size_mib=1, repeats=2)
    for time_row, rate_row in zip(by_metric(records, "time"), by_metric(records, "bandwidth")):
        assert rate_row["value"] == pytest.approx(2 * 2**20 / time_row["value"], rel=1e-12)
        assert json.loads(rate_row["params"])["bytes_moved_per_call"] == 2 * 2**20


def test_sampler_overhead_ratio_is_ratio_of_medians():
    records = calibration.sampler_overhead("cpu", intervals_s=[0.005, 0.01], rounds=3, steps=5)
    ratios = by_metric(records, "time_ratio")
    assert [json.loads(r["params"])["interval_s"] for r in ratios] == [0.005, 0.01]
    first = [r for r in records if json.loads(r["params"]).get("interval_s") == 0.005]
    plain = [r["value"] for r in by_metric(first, "time_plain")]
    sampled = [r["value"] for r in by_metric(first, "time_instrumented")]
    assert len(plain) == len(sampled) == 3
    assert ratios[0]["value"] == pytest.approx(statistics.median(sampled) / statistics.median(plain))
    min_ratio = by_metric(first, "time_ratio_min")[0]["value"]
    assert min_ratio == pytest.approx(min(sampled) / min(plain))
    [sample_time] = by_metric(records, "sample_time")
    assert sample_time["unit"] == "s" and sample_time["value"] > 0


def test_tracker_overhead_reports_allocations_per_call_and_restores_threads():
    threads = torch.get_num_threads()
    records = calibration.tracker_overhead("cpu", rounds=1)
    assert torch.get_num_threads() == threads
    ratios = {(r["case"], r["variant"]): json.loads(r["params"]) for r in by_metric(records, "time_ratio")}
    # 100 steps x 3 temporaries (tanh, *0.5, +x), each 10,000 float64
    assert ratios["tracker_overhead", "numpy"]["allocations_per_call"] == 300
    assert ratios["tracker_overhead", "torch"]["allocations_per_call"] > 0
    assert {p["tracker"] for (case, _), p in ratios.items() if case == "tracker_overhead"} == {"memray"}
    # the same workloads with Python's allocator traced too: each tensor wrapper is one more allocation
    python = ratios["tracker_overhead_python", "torch"]
    assert python["tracker"] == "memray + Python allocators" and python["python_allocations_per_call"] > 0
    assert set(ratios) == {(case, library) for case in ("tracker_overhead", "tracker_overhead_python")
                           for library in ("numpy", "torch")}


@pytest.mark.parametrize("call, message", [
    (lambda: calibration.matmul_flops("cpu", sizes=[0]), "sizes must be a non-empty list"),
    (lambda: calibration.matmul_flops("cpu", sizes=[8], dtypes=["float16"]), "subset of"),
    (lambda: calibration.copy_bandwidth("cpu", size_mib=-1), "size_mib"),
    (lambda: calibration.sampler_overhead("cpu", intervals_s=[]), "intervals_s"),
    (lambda: calibration.tracker_overhead("cpu", rounds=0), "rounds"),
])
def test_bad_sizes_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_figures_and_summary_from_records():
    records = (calibration.matmul_flops("cpu", sizes=[8, 16], repeats=2)
               + calibration.copy_bandwidth("cpu", size_mib=1, repeats=2)
               + calibration.sampler_overhead("cpu", intervals_s=[0.01], rounds=1, steps=5))
    frame = records_frame(records)
    assert {t.name for t in plots.flop_rate_figure(frame).data} == {
        "numpy float32", "numpy float64", "torch float32", "torch float64"}
    assert len(plots.bandwidth_figure(frame).data) == 2
    assert list(plots.overhead_frame(frame)["setting"]) == ["sampler every 10 ms"]
    assert [t.name for t in plots.overhead_figure(frame).data] == ["ratio of medians",
                                                                    "ratio of minima"]
    table = calibration.headline_frame(frame)
    assert set(table["metric"]) == {"flop_rate", "bandwidth", "time_ratio", "time_ratio_min",
                                    "sample_time"}
    assert set(table["unit"]) == {"GFLOP/s", "GB/s", "ratio", "μs"}
    with pytest.raises(ValueError, match="no 'copy' rows"):
        plots.bandwidth_figure(frame[frame["case"] != "copy"])


def test_notebook_is_thin_parameterized_and_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    tagged = {tag: cell for cell in nb.cells for tag in cell.metadata.get("tags", [])}
    params = {}
    exec(tagged["parameters"].source, {}, params)
    assert params["device"] == "auto" and params["results_dir"] == ""
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_overhead_frame_labels_each_instrument():
    from benchlib.records import make_record

    labels = dict(benchmark="calibration", engine="torch", device="cpu", dtype="float32",
                  metric="time_ratio", unit="ratio")
    frame = records_frame([
        make_record(**labels, case="sampler_overhead", value=1.02, params={"interval_s": 0.001}),
        make_record(**labels, case="tracker_overhead", value=1.28,
                    params={"tracker": "memray", "workload": "torch autograd MLP"}),
    ])
    table = plots.overhead_frame(frame)
    assert list(table["setting"]) == ["sampler every 1 ms", "memray: torch autograd MLP (cpu)"]
    assert list(table["ratio"]) == [1.02, 1.28]


def test_interleaved_calls_each_variant_once_per_round_in_shuffled_order():
    calls = []
    times = calibration._interleaved({k: (lambda k=k: calls.append(k) or 1.0) for k in "abc"},
                                     rounds=6)
    assert times == {k: [1.0] * 6 for k in "abc"}
    rounds = [calls[i:i + 3] for i in range(0, 18, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
