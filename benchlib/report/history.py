"""history.html: the steps `benchlib history` found, one figure per series that stepped, and the runs read."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

import pandas as pd

from benchlib.analysis.history import BY_COMMIT, SERIES_COLUMNS, answer, format_value, series_name
from benchlib.report.page import html_page, table_html
from benchlib.report.plots.history import step_figure


def step_table(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps as the terminal and the page show them, one line each."""
    return pd.DataFrame({
        "series": [series_name(row) for row in steps.itertuples()],
        "from run → to run": [f"{row.from_run} → {row.to_run}" for row in steps.itertuples()],
        "commits": [f"{row.from_commit or '?'} → {row.to_commit or '?'}" for row in steps.itertuples()],
        "before → after (median)": [f"{format_value(row.median_before, row.unit)} → "
                                     f"{format_value(row.median_after, row.unit)}" for row in steps.itertuples()],
        "ratio [95% interval]": [f"{row.ratio:.3g}x [{row.ci_low:.3g}, {row.ci_high:.3g}]"
                                 for row in steps.itertuples()],
        "label": [row.label + (" (latest)" if row.latest else "") for row in steps.itertuples()],
    })


HISTORY_PAGE = "history.html"


def history_page(series: pd.DataFrame, steps: pd.DataFrame, *, by: str = BY_COMMIT, skipped: Sequence[str] = ()) -> str:
    """history.html: the answer, the steps' table, then one figure per series that stepped, and the
    runs read (and those skipped), so the page alone says what it was told from."""
    parts = ["<h1>benchlib history</h1>",
             f"<pre class='answer' style='white-space: pre-wrap'>{html.escape(answer(steps, series))}</pre>"]
    if not steps.empty:
        parts.append("<h2 id='steps'>Steps</h2><p>A step is a change point of the runs' medians (ruptures, PELT) "
                     "whose ratio after/before, over the pooled trials of the runs on either side, has a 95% "
                     "interval without 1 and moves by more than the threshold.</p>" + table_html(step_table(steps)))
    figure_specs = []
    for key, stepped in steps.groupby(SERIES_COLUMNS, sort=False):
        points = series[(series[SERIES_COLUMNS] == pd.Series(key, index=SERIES_COLUMNS)).all(axis=1)]
        figure_id = f"figure-{len(figure_specs)}"
        figure = step_figure(points, stepped, name=series_name(points.iloc[0]), by=by)
        figure_specs.append({"id": figure_id, "name": series_name(stepped.iloc[0]), "figure": json.loads(figure.to_json())})
        parts.append(f"<div class='figure' id='{figure_id}'></div>")
    runs = (series.groupby(["run_id", "started_at"], dropna=False)
            .agg(started=("started", "first"), commits=("commit", lambda c: ", ".join(sorted(set(c.dropna())))))
            .reset_index().sort_values(["started", "run_id"]).drop(columns="started"))
    parts.append(f"<h2 id='runs'>Runs read ({len(runs)})</h2>" + table_html(runs))
    if skipped:
        parts.append("<h2 id='skipped'>Runs skipped</h2><ul>"
                     + "".join(f"<li>{html.escape(message)}</li>" for message in skipped) + "</ul>")
    return html_page("benchlib history", parts, figure_specs)
