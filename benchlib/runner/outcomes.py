"""What a run's notebooks came to: each notebook's result, the run's, what a notebook's saved records say
of its cases, how long a notebook took last time (the ETA), and the provenance of the model files run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from benchlib.errors import EXIT_INTERRUPTED
from benchlib.records import STATUSES
from benchlib.records.environment import file_provenance
from benchlib.records.places import RUN_INFO
from benchlib.records.store import RecordsUnreadable, read_records_file
from benchlib.runner.notebooks import NotebookSpec

FAILED_CASE_METRIC = "failed"  # the status records a workload saves for a case that failed
NOT_APPLICABLE = "not_applicable"  # ... and for an engine that cannot run a case, with its reason
NOT_RUN_CASE_METRIC = "not_run"  # ... and for a case the --budget left no time for


@dataclass(frozen=True)
class NotebookResult:
    """How one notebook went: status is 'ok', 'partial' (it ran, some cases failed), 'failed',
    'timed out' (stopped by --timeout), 'interrupted' or 'not run'."""

    name: str
    status: str
    duration_s: float
    parameters: dict[str, Any]
    error: str | None = None
    output: Path | None = None
    data_source: str | None = None


@dataclass
class RunResult:
    """The outcome of `run`: where the results are and each notebook's result, in order."""

    run_id: str
    path: Path
    notebooks: list[NotebookResult] = field(default_factory=list)
    interrupted: bool = False
    report: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(result.status == "ok" for result in self.notebooks)

    @property
    def exit_code(self) -> int:
        """0 when every notebook ran cleanly, 130 when interrupted, else 1 (a failed or partial notebook)."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        return 0 if self.ok else 1

    def status_table(self) -> str:
        """The table printed at the end: notebook, status, duration (and the error of a failed one)."""
        width = max([len("notebook")] + [len(result.name) for result in self.notebooks])
        lines = [f"{'notebook':<{width}}  {'status':<11}  {'duration':>9}"]
        for result in self.notebooks:
            line = f"{result.name:<{width}}  {result.status:<11}  {result.duration_s:>7.1f} s"
            if result.data_source:
                line += f"  data={result.data_source}"
            if result.error:
                line += f"  {result.error.splitlines()[0][:120]}"
            lines.append(line)
        lines.append(f"results: {self.path}")
        return "\n".join(lines)


class CaseOutcomes(NamedTuple):
    """What a notebook's saved records say of its cases: one line per failed case ('engine (case): first
    line of its error'), the data sources its records name, how many cases were not run (the --budget
    ran out before them), how many measured values it saved (0 with failures: the notebook failed), and the
    benchmarks whose records it wrote (a model file's notebook writes its model's: the report's section)."""

    failures: list[str]
    sources: list[str]
    not_run: int
    measured: int = 0
    benchmarks: tuple[str, ...] = ()
    inapplicable: tuple[str, ...] = ()  # 'engine (case): why it does not apply', one per not-applicable case

    def judged(self) -> tuple[str, str | None]:
        """The notebook's status and error, where it ran to its end: `partial` where cases failed and some
        measured, `failed` where they failed and none did, or where nothing was measured because no engine asked
        applies (a misspelt checkpoint target, an engine the device lacks: never `ok`), else `ok`."""
        if self.failures:
            return ("partial" if self.measured else "failed",
                    f"{len(self.failures)} case(s) failed: " + "; ".join(self.failures[:3])
                    + (" ..." if len(self.failures) > 3 else ""))
        if not self.measured and self.inapplicable:
            return "failed", ("nothing was measured: no engine asked applies (" + "; ".join(self.inapplicable[:3])
                              + (" ..." if len(self.inapplicable) > 3 else "") + ")")
        return "ok", None


def case_outcomes(run_path: Path, since: float) -> CaseOutcomes:
    """`CaseOutcomes` from the record fragments a notebook wrote since `since`."""
    failures, sources, not_run, measured, benchmarks, inapplicable = [], [], 0, 0, [], []
    for fragment in sorted((run_path / "records").glob("*.parquet")):
        if fragment.stat().st_mtime < since:
            continue
        benchmarks.append(fragment.stem)
        try:
            frame = read_records_file(fragment)
        except RecordsUnreadable as error:  # an unreadable fragment is itself a failure to report
            failures.append(f"{fragment.name}: unreadable records ({error})")
            continue
        params = frame["params"].map(lambda text: json.loads(text) if text else {})
        for row, row_params in zip(frame[frame["metric"] == FAILED_CASE_METRIC].itertuples(), params[frame["metric"] == FAILED_CASE_METRIC]):
            message = (row_params.get("message") or "").strip().splitlines()
            failures.append(f"{row.variant} ({row.case}): {message[0][:200] if message else 'failed'}")
        for row, row_params in zip(frame[frame["metric"] == NOT_APPLICABLE].itertuples(),
                                   params[frame["metric"] == NOT_APPLICABLE]):
            inapplicable.append(f"{row.variant} ({row.case}): {(row_params.get('message') or 'not applicable')[:200]}")
        sources += [source for source in dict.fromkeys(params.map(lambda p: p.get("data"))) if isinstance(source, str)]
        not_run += int((frame["metric"] == NOT_RUN_CASE_METRIC).sum())
        measured += int((~frame["metric"].isin(STATUSES)).sum())
    return CaseOutcomes(failures, list(dict.fromkeys(sources)), not_run, measured, tuple(benchmarks),
                        tuple(inapplicable))


def last_duration(root: Path, notebook: str, quick: bool) -> float | None:
    """How long `notebook` took in the most recent finished run under `root` with the same --quick:
    the basis of the ETA."""
    best: tuple[str, float] | None = None
    for info_path in root.glob(f"*/{RUN_INFO}"):
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        entry = info.get("notebooks", {}).get(notebook, {})
        if info.get("quick") == quick and entry.get("status") == "ok" and entry.get("duration_s"):
            started = str(entry.get("started_at", ""))
            if best is None or started > best[0]:
                best = (started, float(entry["duration_s"]))
    return best[1] if best else None


def model_file_provenance(planned: Sequence[tuple[NotebookSpec, dict[str, Any]]]) -> dict[str, Any]:
    """run.json's provenance of each model file: by NAME, or by NAME/version for versions of one."""
    from benchlib.usermodel import version_labels

    files = {}
    for spec, _ in planned:
        labels = [spec.name] if len(spec.sources) == 1 else [f"{spec.name}/{v}" for v in version_labels(spec.sources)]
        files.update({label: file_provenance(source) for label, source in zip(labels, spec.sources)})
    return files


