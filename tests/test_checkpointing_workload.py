"""The checkpointing notebook's workload: every budget measured beside manual, counters and Revolve's prediction."""

import io
import json

import pandas as pd
import pytest

from benchlib.autodiff.checkpoint import revolve_cost
from benchlib.report.plots.checkpointing import budget_table, tradeoff_figure
from benchlib.workloads import checkpointing


def test_budgets_are_checked_by_the_declaration_before_any_process_starts():
    for bad, message in (([], "non-empty list"), ([0, 2], r"0 is not valid"), ([2, 9], r"integers in 1..depth \(8\)"),
                         ([2, 2], "twice"), ("2", "non-empty list")):
        with pytest.raises(ValueError, match=message):
            checkpointing.BENCHMARK.config({"D": 8, "depth": 8, "budgets": bad})


@pytest.mark.slow
def test_each_budget_matches_manual_and_recomputes_what_revolve_predicts():
    config = checkpointing.BENCHMARK.config({"D": 16, "depth": 10, "budgets": [1, 3, 10], "trials": 1})
    comparison = checkpointing.run(config, "cpu", progress=None)
    comparison.check_gradients()
    frame = comparison.frame()
    table = budget_table(frame)
    assert table["budget"].tolist() == ["1", "3", "10", "sqrt"]
    measured = table.set_index("budget")
    for budget in (1, 3, 10):
        assert measured.loc[str(budget), "recomputed_nodes"] == revolve_cost(10, budget)
        assert measured.loc[str(budget), "revolve_recomputations"] == revolve_cost(10, budget)
    assert measured.loc["1", "saved_bytes_peak"] < measured.loc["10", "saved_bytes_peak"]
    errors = frame[frame["metric"] == "grad_max_rel_err"]["value"]
    assert len(errors) == 4 and (errors == 0).all()  # the same operations: bit for bit
    figure = tradeoff_figure(frame, title="t")
    assert {trace.name for trace in figure.data} >= {"recomputed (measured)", "Revolve's prediction"}


@pytest.mark.slow
def test_notebook_runs_with_quick_sizes(tmp_path):
    from benchlib.runner import run

    result = run(["checkpointing"], device="cpu", out=tmp_path, quick=True, progress=False, stream=io.StringIO())
    assert result.ok, result.status_table()
    records = pd.read_parquet(result.path / "records" / "checkpointing.parquet")
    budgets = {json.loads(p)["budget"] for p in records["params"]}
    assert budgets == {2, 4, 12, "sqrt"}
    assert (result.path / "figures" / "checkpointing_tradeoff.html").is_file()
    assert (result.path / "tables" / "checkpointing_headline.parquet").is_file()
