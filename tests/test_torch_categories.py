"""torch.profiler's categories of one step, beside benchlib's roles: exact bytes where torch's category is
a known tensor (the parameters, the batch), and the report's table that lines the two up."""

import pandas as pd
import torch

from benchlib.engine_names import TORCH
from benchlib.measure.torch_categories import CATEGORIES, torch_categories
from benchlib.records import make_record, records_frame
from benchlib.records.metrics import METRICS
from benchlib.report.tables.sites import categories_table
from benchlib.usermodel.case import CASE_METRICS
from benchlib.engines.techniques import Step


def test_torch_sees_the_parameters_and_the_batch_with_their_exact_bytes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    batch = (torch.randn(5, 4), torch.randn(5, 1))
    step = Step(TORCH, model, batch, lambda m, x, y: ((m(x) - y) ** 2).mean(), lambda p: torch.optim.SGD(p, lr=0.1))
    step()
    categories = torch_categories(step)
    assert set(categories) == {f"torch_{name}_bytes" for name in (*CATEGORIES, "peak")}
    assert categories["torch_parameter_bytes"] == 4 * (4 * 8 + 8 + 8 + 1)
    assert categories["torch_input_bytes"] == 4 * (5 * 4 + 5 * 1)
    assert categories["torch_optimizer_state_bytes"] == 0  # plain SGD keeps no state
    assert categories["torch_peak_bytes"] == sum(value for name, value in categories.items() if name != "torch_peak_bytes")


def test_the_report_lines_up_roles_and_categories_per_engine():
    for metric in CASE_METRICS:  # a model file's benchmark registers them (Benchmark.register)
        METRICS.register(*metric)

    def row(engine, metric, value):
        return make_record(benchmark="m", case="step", engine=engine, device="cpu", dtype="float32", metric=metric,
                           value=value)

    records = records_frame([row(TORCH, "role_parameter_bytes", 2000.0), row(TORCH, "torch_parameter_bytes", 2000.0),
                             row(TORCH, "torch_peak_bytes", 9000.0), row(TORCH, "tracked_peak_bytes", 5000.0),
                             row("torch.func", "role_parameter_bytes", 2000.0)])  # no categories: not a column
    table = categories_table(records, "step")
    assert list(table.columns) == [(TORCH, "benchlib"), (TORCH, "torch.profiler")]
    assert table.loc["parameters"].tolist() == ["2.000\u00a0kB", "2.000\u00a0kB"]
    assert table.loc["temporaries"].tolist() == ["", ""]
    assert table.iloc[-1].tolist() == ["5.000\u00a0kB", "9.000\u00a0kB"]
    assert categories_table(records_frame([row(TORCH, "time", 1.0)]), "step").empty
