"""A benchmark declared with `measure` (no notebook of its own), run inside the runner's generic notebook.

The kernel looks the benchmark up in the registry as the runner did (a model file is loaded again from its path), builds its config from the
injected values (checked again: a kernel trusts nothing it was handed), measures, and saves what
every notebook saves: records, a headline table of the declared headline metrics, and figures.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from benchlib import registry
from benchlib.records import Run
from benchlib.report.figure_files import save_figure
from benchlib.report.page import HEADLINE_SUFFIX
from benchlib.analysis.stats import median_interval
from benchlib.trials import Interrupted


@dataclass(frozen=True)
class Outcome:
    """What one run of a declared benchmark saved: its records, headline table and figures, and the run
    they went into (for `benchlib.runner.interactive.finish_notebook`)."""

    records: pd.DataFrame
    headline: pd.DataFrame
    figures: dict[str, Any] = field(default_factory=dict)
    run: Run | None = None


def headline_table(records: pd.DataFrame, metrics: tuple[str, ...]) -> pd.DataFrame:
    """Per case, variant and headline metric: the median over its values with a 95% interval (a point
    when there is one value) and how many values it has; all metrics when none are declared."""
    rows = records[records["metric"].isin(metrics)] if metrics else records[records["value"].notna()]
    table = []
    for (case, variant, metric, unit), group in rows.groupby(["case", "variant", "metric", "unit"], sort=False):
        values = group["value"].dropna().to_numpy(float)
        if values.size == 0:
            continue
        interval = median_interval(values) if values.size > 1 else None
        table.append({"case": case, "variant": variant, "metric": metric, "median": float(pd.Series(values).median()),
                      "ci_low": interval.ci_low if interval else math.nan,
                      "ci_high": interval.ci_high if interval else math.nan, "unit": unit, "n": int(values.size)})
    return pd.DataFrame(table, columns=["case", "variant", "metric", "median", "ci_low", "ci_high", "unit", "n"])


def run_declared(name: str | list[str], parameters: Mapping[str, Any], *, device: str = "auto",
                 results_dir: str = "", checked: Mapping[str, str] | None = None) -> Outcome:
    """Measure benchmark `name` (or a model file's path, or the paths of versions of one) with `parameters` on
    `device` and save its results into `results_dir`; `checked`: the digests of model-file contents the runner's
    form check passed (`registry.resolve`), not checked again."""
    from benchlib.measure import resolve_device
    from benchlib.measure.cuda_snapshot import snapshot_folder
    from benchlib.records.store import CUDA_SNAPSHOT_FOLDER

    benchmark = registry.resolve(name, checked)
    config = benchmark.config(parameters)
    resolved = resolve_device(device)
    run = Run.open(results_dir, device=resolved, config=config)
    with snapshot_folder(run.path / CUDA_SNAPSHOT_FOLDER):  # on CUDA, each engine's allocator snapshot
        try:
            measured = benchmark.measure(config, resolved)
        except Interrupted as stopped:  # Ctrl-C: the trials that finished are kept, then the interrupt goes on
            if stopped.records:
                run.save_records(stopped.records, benchmark.name)
                print(f"{benchmark.name}: interrupted; the {len(stopped.records)} records of its finished trials "
                      f"are in {run.path}")
            raise
        frame = run.save_records(measured, benchmark.name)
    headline = benchmark.summarize(frame) if benchmark.summarize else headline_table(frame, benchmark.headline)
    run.save_table(headline, f"{benchmark.name}{HEADLINE_SUFFIX}")
    figures = {}
    for figure_name, build in benchmark.figures.items():
        figures[figure_name] = build(frame)
        save_figure(run, figures[figure_name], f"{benchmark.name}_{figure_name}")
    print(f"{benchmark.name}: {len(frame)} records in {run.path}")
    return Outcome(frame, headline, figures, run)


def run_model_file(config, *, device: str = "auto", results_dir: str = ""):
    """The your_model notebook's run: `config` names the model file (empty: `benchlib new`'s example) and whether
    to run at its QUICK values; records, summary and figures saved in `results_dir`."""
    from benchlib.usermodel import load_model_file
    from benchlib.usermodel.named import resolved
    from benchlib.usermodel.template import TEMPLATE

    with tempfile.TemporaryDirectory(prefix="benchlib-example-") as folder:
        path = Path(resolved(config.model_file) or Path(folder) / "my_model.py")
        if not config.model_file:
            path.write_text(TEMPLATE, encoding="utf-8")
        values = load_model_file(path).quick if config.quick else {}
        return run_declared(str(path), values, device=device, results_dir=results_dir)
