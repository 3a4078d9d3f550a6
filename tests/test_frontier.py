"""The memory/time frontier of a model file's engines, on records the test writes: which engines no other beats
on both peak and time, the answer lines that lead the summary, and the figure."""

import pandas as pd
import pytest

from benchlib.records import make_record
from benchlib.analysis.frontier import frontier_frame
from benchlib.report.plots.usermodel import frontier
from benchlib.usermodel.summary import ENGINE_WIDTH, summary_table

# engine: (resident peaks in MB over trials, times in ms); "slowfat" is beaten by torch on both
ENGINES = {"torch": ((40, 41), (10, 11)), "torch-checkpoint": ((12, 12.5), (14, 15)),
           "torch-microbatch": ((20, 21), (12, 12.5)), "slowfat": ((50, 52), (30, 31)),
           "torch.func": ((5, 5.5), (40, 42))}


def records(unchecked=(), failed=()):
    rows = []
    for engine, (peaks, times) in ENGINES.items():
        labels = dict(benchmark="m", case="step", engine=engine, device="cpu", dtype="float32")
        for trial, (peak, time) in enumerate(zip(peaks, times)):
            rows.append(make_record(**labels, metric="peak_bytes", value=peak * 1e6, unit="B", params={"trial": trial}))
            rows.append(make_record(**labels, metric="time", value=time / 1e3, unit="s", params={"trial": trial}))
            if engine in unchecked:
                rows.append(make_record(**labels, metric="grad_check_unavailable", value=1.0,
                                        params={"trial": trial, "message": "stochastic"}))
        if engine in failed:
            rows.append(make_record(**labels, metric="failed", value=float("nan"), params={"message": "not the same maths"}))
    return pd.DataFrame(rows)


def test_the_frontier_holds_the_engines_no_other_beats_on_both_peak_and_time():
    frame = frontier_frame(records()).set_index("engine")
    assert frame.index[frame["pareto"]].tolist() == ["torch", "torch-checkpoint", "torch-microbatch", "torch.func"]
    assert set(frame["peak_metric"]) == {"peak_bytes"}  # every resident peak is above a MB: it decides
    assert frame.loc["slowfat", "peak"] == 51e6 and frame.loc["slowfat", "trials"] == 2


def test_an_unchecked_engine_is_drawn_but_never_on_the_frontier_and_a_failed_one_not_at_all():
    frame = frontier_frame(records(unchecked=("torch.func",), failed=("torch-microbatch",))).set_index("engine")
    assert "torch-microbatch" not in frame.index
    assert not frame.loc["torch.func", "checked"] and not frame.loc["torch.func", "pareto"]
    assert frame.index[frame["pareto"]].tolist() == ["torch", "torch-checkpoint"]


def test_the_summary_answers_with_the_fastest_engine_under_each_memory_level():
    lines = summary_table(records())["summary"].tolist()
    start = lines.index("fastest within a memory level (resident peak; engines whose gradient was checked):")
    answer = [line.split(":")[1].split()[0] for line in lines[start + 1:]]
    assert answer == ["torch.func", "torch-checkpoint", "torch-microbatch", "torch"]  # lowest peak first
    assert lines[start + 1].startswith(f"  up to   5.250 MB: {'torch.func':<{ENGINE_WIDTH}} 41.00 ms [40.00 ms, 42.00 ms]/step")


def test_the_figure_draws_every_measured_engine_and_the_frontier_line():
    fig = frontier(records())
    names = [trace.name for trace in fig.data]
    assert names[0] == "frontier" and list(fig.data[0].x) == pytest.approx([41.0, 14.5, 12.25, 10.5])
    assert set(names[1:]) == set(ENGINES)
    assert "ms" in fig.layout.xaxis.title.text and "MB" in fig.layout.yaxis.title.text


def test_a_summary_where_every_engine_failed_names_each_failure_and_no_frontier():
    from benchlib.records import records_frame, status_record

    rows = [status_record(status="failed", message=f"NonFiniteGradient: the gradient holds NaN ({engine})",
                          benchmark="my_mlp", case="step", engine=engine, device="cpu", dtype="float32")
            for engine in ("torch", "torch.func")]
    table = summary_table(records_frame(rows))  # a NaN loss: before, the frontier's sort raised KeyError 'peak'
    assert list(table["status"]) == ["failed", "failed"] and "frontier" not in set(table["status"])
    assert table["reason"].tolist() == [f"NonFiniteGradient: the gradient holds NaN ({engine})" for engine in ("torch", "torch.func")]
