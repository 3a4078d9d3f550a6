"""A notebook run in JupyterLab, without the runner, ends as a finished run: the same run.json a batch
run leaves (its notebook's status, duration and failed cases), the seed verdicts judged and report.html
written, so `benchlib runs`, `compare`, `history` and the report treat it like any other run.

Each notebook's last cell calls `finish_notebook(run)`. Under the runner it does nothing: the run is
the runner's, which finishes it after the notebook (and the others) ran. A notebook whose cells stopped
before the last one leaves its run `running` while the kernel lives and `stale: runner gone` after.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from benchlib.records import Run
from benchlib.records.places import now_iso
from benchlib.records.store import OPENED_BY_NOTEBOOK
from benchlib.runner.outcomes import case_outcomes

RUNNING = "running"


def finish_notebook(run: Run) -> Path | None:
    """End a run the notebook opened itself (`Run.open` with no run.json to join): each notebook still
    `running` becomes `ok`, or `partial` / `failed` when cases failed (as the runner judges them), then
    the verdicts, run.json's end and report.html. Returns the report's path, or None when the run is
    the runner's (or already ended)."""
    if run.info.get("created_by") != OPENED_BY_NOTEBOOK or run.info.get("ended_at"):
        return None
    from benchlib.analysis.seed_verdicts import save_verdicts, seed_verdicts
    from benchlib.records import load_records
    from benchlib.registry import verdict_rules
    from benchlib.report.page import write_report

    ended = now_iso()
    outcomes = case_outcomes(run.path, since=0.0)
    failures, sources, not_run = outcomes.failures, outcomes.sources, outcomes.not_run
    for name, entry in run.info.get("notebooks", {}).items():
        if entry.get("status") != RUNNING:
            continue
        status, error = outcomes.judged()
        duration = (datetime.fromisoformat(ended) - datetime.fromisoformat(entry["started_at"])).total_seconds()
        run.record_notebook(name, status=status, ended_at=ended, duration_s=round(duration, 3), error=error,
                            failed_cases=failures, not_run_cases=not_run, data_source="+".join(sources) or None)
    if (run.path / "records.parquet").exists():
        save_verdicts(seed_verdicts(load_records(run.path), verdict_rules()), run.path)
    run.finish(interrupted=False)
    report = write_report(run.path)
    print(f"run {run.run_id} finished: {report}")
    return report
