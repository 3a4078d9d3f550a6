"""`benchlib fit`: the fit's answer printed, its records, figure and report in a run directory of their own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

EXIT_FITS, EXIT_NONE_FITS = 0, 1


def fit_command(file: str, *, memory: str, scale: str, device: str, engines: str | None, params: dict[str, Any],
                verify: bool, out: Path | None) -> int:
    """Fit, print, save; 0 when some engine fits, 1 when none fits at the smallest value (refusals raise)."""
    import pandas as pd

    from benchlib.measure import resolve_device
    from benchlib.report.page import HEADLINE_SUFFIX, SUMMARY_COLUMN
    from benchlib.records import Run
    from benchlib.report.plots.usermodel import fit_figure
    from benchlib.report.page import write_report
    from benchlib.records.store import default_results_root
    from benchlib.usermodel.fit import fit

    chosen = [name.strip() for name in engines.split(",") if name.strip()] if engines else None
    started = time.monotonic()
    result = fit(file, memory=memory, scale=scale, device=device, engines=chosen, params=params, verify=verify)
    print("\n".join(result.lines()))
    name = f"{result.name}_fit"
    question = f"What is the largest {scale} at which {Path(file).name}'s step fits in {memory}, and under which engine?"
    run = Run.create(out or default_results_root(), resolve_device(device).name, notebooks={},
                     benchmarks={name: {"question": question}}, command=["benchlib", "fit", file])
    frame = run.save_records(result.records(), result.name)
    run.save_table(pd.DataFrame({SUMMARY_COLUMN: result.lines()}), f"{result.name}{HEADLINE_SUFFIX}")
    run.save_figure(fit_figure(frame), name)
    run.record_notebook(name, status="ok", benchmarks=[result.name], path=str(Path(file).resolve()),
                        duration_s=round(time.monotonic() - started, 3))
    run.finish(interrupted=False)
    print(f"report: {write_report(run.path)}")
    return EXIT_FITS if result.best is not None else EXIT_NONE_FITS
