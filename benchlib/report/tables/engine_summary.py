"""Tables of an engine comparison (`benchlib.trials.cases.EngineComparison`) as a notebook or a terminal shows
them: MB, each ratio as "1.02 [0.98, 1.07]" headed by its baseline, seconds, the compile's seconds apart, the
gradient error; and the whole comparison as text, with what planning changed and every problem."""

from __future__ import annotations

import math

import pandas as pd

from benchlib.analysis.engine_summary import REFERENCE_ENGINE, SEED_ENGINE, SUMMARY_COLUMNS
from benchlib.records.metrics import COMPILE_COLUMN, GRAD_ERROR_METRIC

# Each ratio column of `summarize` headed by its baseline, wherever a table is printed.
RATIO_HEADINGS = {"peak_ratio": f"peak/{REFERENCE_ENGINE}", "time_ratio": f"time/{REFERENCE_ENGINE}",
                  "peak_ratio_seed": f"peak/{SEED_ENGINE}"}


def with_interval(summary: pd.DataFrame, column: str) -> pd.Series:
    """A ratio column as text, "1.02 [0.98, 1.07]" (its 95% interval), or the ratio alone without one."""
    def text(row) -> str:
        if math.isnan(row[column]):
            return "—"
        low, high = row[f"{column}_low"], row[f"{column}_high"]
        return f"{row[column]:.3g}" if math.isnan(low) else f"{row[column]:.3g} [{low:.3g}, {high:.3g}]"

    return summary.apply(text, axis=1) if not summary.empty else pd.Series(dtype=str)


def comparison_frame(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary (`EngineComparison.summary_frame`) as shown: MB, each ratio with its interval headed by its
    baseline (to manual and, where it ran, to manual-seed), seconds, the compile's seconds where an engine compiled
    (in the set-up, never in time_s), the gradient error."""
    shown = summary.assign(peak_MB=summary["peak_bytes"] / 1e6, peak_ratio=with_interval(summary, "peak_ratio"),
                           time_ratio=with_interval(summary, "time_ratio"),
                           peak_ratio_seed=with_interval(summary, "peak_ratio_seed"))
    params = [column for column in summary.columns if column not in SUMMARY_COLUMNS]  # `summary_frame(params=...)`'s
    columns = ["case", *params, "engine", "status", "trials", "stop", "peak_MB", "peak_ratio", "time_s", "time_ratio",
               *(["peak_ratio_seed"] if summary["peak_ratio_seed"].notna().any() else []),
               *([COMPILE_COLUMN] if summary[COMPILE_COLUMN].notna().any() else []), GRAD_ERROR_METRIC]
    return shown[columns].rename(columns=RATIO_HEADINGS)


def comparison_text(comparison) -> str:
    """`comparison_frame` as plain text, then what planning changed, the reasons and the problems."""
    summary = comparison.summary_frame()
    if summary.empty:
        return "no cases ran"
    shown = comparison_frame(summary)
    text = "\n".join(comparison.notes + [shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")])
    for row in summary[(summary["status"] == "ok") & (summary["reason"] != "")].itertuples():
        text += f"\n{row.engine} ({row.case}): {row.reason}"
    for problem in comparison.problems:
        text += f"\n\n{problem.engine} ({problem.case}) {problem.status}: {problem.message}"
    return text
