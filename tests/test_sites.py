"""Allocation sites (--attribute): known allocations of known size at known lines, diffs, records, report."""

from __future__ import annotations

import inspect
import json
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from benchlib.measure import Measurement, attribute_allocations, measure
from benchlib.measure.allocations import memray_available
from benchlib.records import records_frame
from benchlib.analysis.sites import (DIFF_BYTES, SITE_BYTES, attribution_cost, diff_records, diff_sites, diff_table,
                                    own_first, site_table)

needs_memray = pytest.mark.skipif(not memray_available(), reason="memray is not installed")
MB = 1_000_000


def _line(function, text: str) -> int:
    """The line of `function`'s source that contains `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if text in line)


def _holds_and_churns():
    kept = np.ones(MB)  # KEPT: 8,000,000 bytes live at the peak
    for _ in range(3):
        np.ones(MB // 2).max()  # CHURN: 4,000,000 bytes made and freed, three times
    return kept


@needs_memray
def test_a_known_buffer_is_found_at_its_line_with_its_exact_bytes():
    _holds_and_churns()
    attribution = attribute_allocations(_holds_and_churns)
    kept_line, churn_line = _line(_holds_and_churns, "# KEPT"), _line(_holds_and_churns, "# CHURN")
    top = attribution.peak[0]
    assert (top.file, top.line, top.function) == (__file__, kept_line, "_holds_and_churns")
    assert (top.bytes, top.count) == (8 * MB, 1)
    assert top.inner.startswith("numpy/") and top.inner.endswith(" in ones")  # the primitive that allocated
    assert top.where == "test_sites.py"
    # the churning line: three buffers of 4 MB, each freed before the next allocation (and max's own scratch)
    temporary = {(site.line, site.function): site for site in attribution.temporary}
    churn = temporary[churn_line, "_holds_and_churns"]
    assert churn.bytes >= 3 * 4 * MB and churn.bytes - 3 * 4 * MB < 10_000
    allocated = {site.line: site for site in attribution.allocated}
    assert allocated[kept_line].bytes == 8 * MB and allocated[kept_line].count == 1
    assert attribution.peak_bytes >= 12 * MB  # the kept buffer and one temporary at once
    assert attribution.call_s > 0 and attribution.read_s > 0


@needs_memray
def test_python_allocators_add_the_array_objects_to_the_sites():
    attribution = attribute_allocations(_holds_and_churns, python_allocators=True)
    top = attribution.peak[0]
    assert top.line == _line(_holds_and_churns, "# KEPT")
    assert 8 * MB < top.bytes < 8 * MB + 1000  # the buffer and the ndarray object around it
    assert attribution.python_allocators


_COUNTS = """
import json
from benchlib.measure import measure
from test_sites import _holds_and_churns
counts = [measure(_holds_and_churns, repeats=2, name="hold", attribute=attribute) for attribute in (False, True)]
print(json.dumps([[m.alloc_bytes, m.alloc_count] for m in counts]))
"""


@pytest.mark.slow
@needs_memray
def test_measure_with_attribute_keeps_the_other_passes_and_records_the_sites():
    # the allocation counts compared in a fresh process: the system allocator's counts take in threads with no
    # Python frame (torch's and BLAS's pools), and this suite's process keeps other such threads from earlier
    # tests (a notebook client's zmq I/O), whose allocations would land in either pass
    counted = subprocess.run([sys.executable, "-c", _COUNTS], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).parent, check=True)
    plain, attributed_counts = json.loads(counted.stdout.splitlines()[-1])
    assert attributed_counts == plain and plain[0] >= 8 * MB + 3 * 4 * MB
    attributed = measure(_holds_and_churns, repeats=2, name="hold", attribute=True)
    assert measure(_holds_and_churns, repeats=1, name="hold").attribution is None
    back = Measurement.from_dict(json.loads(json.dumps(attributed.to_dict())))
    assert back.attribution == attributed.attribution
    records = records_frame(attributed.records(benchmark="b", engine="numpy", dtype="float64"))
    assert set(records["metric"]) >= {"time", SITE_BYTES, "site_count", "attribution_call_time",
                                      "attribution_read_time", "attribution_peak_bytes"}
    sites = site_table(records, "peak")
    first = sites.iloc[0]
    assert (first["site"], first["function"], first["bytes"], first["count"], bool(first["own"])) == (
        f"test_sites.py:{_line(_holds_and_churns, '# KEPT')}", "_holds_and_churns", 8 * MB, 1, True)
    assert 0.5 < first["share"] <= 1
    cost = attribution_cost(records)
    assert len(cost) == 1 and cost["factor"].iloc[0] > 0 and cost["plain_s"].iloc[0] > 0


def test_from_dict_reads_a_measurement_written_before_attribution():
    data = measure(lambda: None, repeats=1, track_allocations=False).to_dict()
    del data["attribution"]
    assert Measurement.from_dict(data).attribution is None


def _sites(rows):
    return pd.DataFrame(rows, columns=["site", "function", "inner", "bytes", "count"])


def test_diff_sites_sorts_by_the_difference_and_names_the_change():
    a = _sites([("m.py:3", "loss", "", 100, 1), ("m.py:5", "loss", "", 1000, 2), ("m.py:9", "step", "", 50, 1),
                ("m.py:7", "loss", "", 10, 1)])
    b = _sites([("m.py:3", "loss", "", 100, 1), ("m.py:5", "loss", "", 400, 2), ("m.py:8", "step", "", 700, 3),
                ("m.py:7", "loss", "", 10, 4)])
    diff = diff_sites(a, b)
    assert list(diff["site"]) == ["m.py:8", "m.py:5", "m.py:9", "m.py:7", "m.py:3"]
    assert list(diff["bytes_diff"]) == [700, -600, -50, 0, 0]
    assert list(diff["change"]) == ["only in b", "fewer", "only in a", "different", "same"]
    assert list(diff["count_diff"]) == [3, 0, -1, 3, 0]


def test_diff_sites_sums_over_the_key_and_refuses_a_table_without_it():
    a = _sites([("v1.py:3", "loss", "torch/nn/functional.py:10 in linear", 100, 1),
                ("v1.py:4", "loss", "torch/nn/functional.py:10 in linear", 50, 1)])
    b = _sites([("v2.py:6", "loss", "torch/nn/functional.py:10 in linear", 400, 2)])
    diff = diff_sites(a, b, by=("function", "inner"))
    assert len(diff) == 1 and diff["bytes_diff"].iloc[0] == 250 and diff["change"].iloc[0] == "more"
    with pytest.raises(ValueError, match="lacks"):
        diff_sites(a.drop(columns="bytes"), b)


def test_diff_records_round_trip_through_the_records_frame():
    a = _sites([("m.py:5", "loss", "", 1000, 2)])
    b = _sites([("m.py:5", "loss", "", 400, 2), ("m.py:8", "step", "", 700, 3)])
    rows = diff_records(diff_sites(a, b), a="initial", b="new", of="allocated", benchmark="b", case="c",
                        engine="torch", device="cpu", dtype="float32")
    frame = records_frame(rows)
    assert set(frame["metric"]) == {DIFF_BYTES, "site_count_diff"}
    table = diff_table(frame)
    assert list(table["site"]) == ["(all sites)", "m.py:8", "m.py:5"]
    assert list(table["bytes_diff"]) == [100, 700, -600] and list(table["change"]) == ["more", "only in b", "fewer"]
    same = diff_table(records_frame(diff_records(diff_sites(a, a), a="x", b="y", of="peak", benchmark="b", case="c",
                                                 engine="torch", device="cpu", dtype="float32")))
    assert list(same["site"]) == ["(all sites)"] and list(same["change"]) == ["same"]
    assert set(table["of"]) == {"allocated"} and set(table["a"]) == {"initial"}


def test_own_first_puts_the_users_lines_before_library_frames():
    sites = pd.DataFrame({"site": ["torch/autograd/graph.py:829", "m.py:5", "m.py:9"], "own": [False, True, True],
                          "bytes": [900, 100, 300]})
    assert list(own_first(sites)["site"]) == ["m.py:9", "m.py:5", "torch/autograd/graph.py:829"]


# ---------------------------------------------------------------- --attribute through the runner

WIDE_MODEL = '''import torch

PARAMETERS = {"width": 256, "batch_size": 64}
QUICK = {"width": 256, "batch_size": 64}


class Wide(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.out = torch.nn.Linear(8 * width, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        wide = torch.cat([h] * 8, dim=1)  # WIDE: batch x 8 width floats, saved for the backward pass
        return self.out(wide)


def model(width, batch_size):
    return Wide(width)


def batch(width, batch_size):
    return torch.randn(batch_size, 32), torch.randn(batch_size, 1)


def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()
'''


@pytest.mark.slow
@needs_memray
def test_attribute_names_the_users_line_holding_the_peak_in_records_and_report(tmp_path, capsys):
    from benchlib.records import load_records
    from benchlib.runner.cli import main

    path = tmp_path / "wide.py"
    path.write_text(WIDE_MODEL)
    out = tmp_path / "runs"
    assert main(["run", str(path), "--quick", "--attribute", "-p", "trials=1", "-p", "engines=torch,torch.func",
                 "--out", str(out), "--no-progress"]) == 0
    run = next(out.iterdir())
    records = load_records(run)
    line = next(number for number, text in enumerate(WIDE_MODEL.splitlines(), start=1) if "# WIDE" in text)
    sites = site_table(records, "peak")
    held = 64 * 8 * 256 * 4  # the concatenated activations, float32
    for engine in ("torch", "torch.func"):
        own = own_first(sites[sites["variant"] == engine]).iloc[0]
        assert (own["site"], own["function"], bool(own["own"])) == (f"wide.py:{line}", "forward", True)
        assert held <= own["bytes"] < held + 4096  # the buffer, and the tensor's own small C++ allocations
        # one attribution pass per engine (first trial), apart from the measured ones
        assert (records[(records["variant"] == engine)]["metric"] == "attribution_call_time").sum() == 1
    diffs = diff_table(records)
    assert set(diffs["a"]) == {"torch"} and set(diffs["b"]) == {"torch.func"}
    page = (run / "report.html").read_text()
    assert "Where the peak is" in page and "What the capture cost" in page and "Site-by-site diffs" in page
    assert f"your line holding most of the peak is wide.py:{line} in forward" in page


@pytest.mark.slow
def test_attribute_is_refused_before_anything_runs_without_memray(tmp_path, capsys, monkeypatch):
    import benchlib.measure.allocations as allocations
    from benchlib.runner.cli import main

    path = tmp_path / "wide.py"
    path.write_text(WIDE_MODEL)
    monkeypatch.setattr(allocations, "memray_available", lambda: False)
    out = tmp_path / "runs"
    assert main(["run", str(path), "--quick", "--attribute", "--out", str(out)]) == 2
    assert "memray" in capsys.readouterr().err and not out.exists()


def test_attribute_is_refused_for_benchmarks_without_an_attribution_pass(tmp_path, capsys):
    from benchlib.runner.cli import main

    out = tmp_path / "runs"
    assert main(["run", "dot_chain", "--quick", "--attribute", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "--attribute" in error and "identical_closures" in error and not out.exists()


@needs_memray
def test_identical_closures_attribution_pass_diffs_the_verdict_pairs():
    from benchlib.workloads.closures import Protocol, run_protocol
    from benchlib.workloads.closures.spec import INITIAL, NEW, PAIRS

    protocol = Protocol(warmup=1, repeats=2, cold_passes=1, alloc_passes=1, alloc_samples=1, backend="eager")
    frame = records_frame(run_protocol("reduced", "benchlib-inplace", "seed", device="cpu", protocol=protocol,
                                       attribute=True))
    sites = site_table(frame)
    assert set(sites["kind"]) == {"peak", "temporary", "allocated"}
    assert sites["site"].str.startswith("benchlib/").any()  # benchlib's own frames by their package path
    diffs = diff_table(frame)
    totals = diffs[diffs["site"] == "(all sites)"]
    assert len(totals) == len(PAIRS["warm"]) and set(totals["of"]) == {"allocated"}
    pair = totals[(totals["a"] == INITIAL) & (totals["b"] == NEW)].iloc[0]
    assert pair["bytes_a"] > 0 and pair["count_a"] > 0
