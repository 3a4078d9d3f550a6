"""Shared figure helpers, so every notebook draws an engine in the same colour and layout."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pandas as pd
import plotly.graph_objects as go

from benchlib.report.palette import color as engine_color

TEMPLATE = "plotly_white"


def engine_colors(engines: Iterable[str]) -> dict[str, str]:
    """`color_discrete_map` for plotly express."""
    return {engine: engine_color(engine) for engine in engines}


def log_ticks(low: float, high: float) -> list[float]:
    """1-2-5 tick values spanning [low, high] for a log axis: every tick labelled in full,
    instead of plotly's small '2 3 5' minor digits that read as values."""
    if not (low > 0 and high >= low):
        raise ValueError(f"log ticks need 0 < low <= high, got {low}, {high}")
    ticks, decade = [], 10.0 ** math.floor(math.log10(low))
    while decade <= high * 10:
        ticks += [float(f"{m * decade:.6g}") for m in (1, 2, 5) if low / 2 <= m * decade <= high * 2]
        decade *= 10
    return ticks


def apply_layout(fig: go.Figure, *, title: str, x_title: str | None = None, y_title: str | None = None, height: int = 420) -> go.Figure:
    """The common look: white template, title, axis titles, legend above the plot."""
    fig.update_layout(
        template=TEMPLATE,
        title=title,
        height=height,
        margin=dict(l=60, r=20, t=80, b=50),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
    )
    if x_title is not None:
        fig.update_xaxes(title_text=x_title)
    if y_title is not None:
        fig.update_yaxes(title_text=y_title)
    return fig


def legend_right(fig: go.Figure) -> go.Figure:
    """The legend in a column right of the plot: for figures whose subplot titles sit where
    `apply_layout` puts the legend (above the plot)."""
    return fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1.0, xanchor="left", x=1.01),
                             margin=dict(r=190))


def log_axis(fig: go.Figure, values: pd.Series, **selector) -> go.Figure:
    """A log y axis with labelled 1-2-5 ticks spanning the positive `values` (see `log_ticks`)."""
    positive = values[values > 0]
    if positive.empty:
        return fig.update_yaxes(type="log", **selector)
    low, high = float(positive.min()), float(positive.max())
    ticks = log_ticks(low, high)
    # the range reaches the outer ticks (both ends carry a label) with a margin, so no marker is clipped
    bottom, top = math.log10(min(ticks[0], low)), math.log10(max(ticks[-1], high))
    margin = 0.05 * max(top - bottom, 0.2)
    span = [bottom - margin, top + margin]
    return fig.update_yaxes(type="log", tickmode="array", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks],
                            range=span, **selector)


def ratio_frame(records: pd.DataFrame, *, metric: str, baseline: str, by: Sequence[str] = ("case",)) -> pd.DataFrame:
    """Median over trials of `metric` per (`by`, variant), divided by the `baseline` variant's median in
    the same group, with the ratio's 95% bootstrap interval over trials (`ci_low`, `ci_high`: NaN with
    one trial a side) and the trials' `low`/`high` values.

    Ratios are taken within one frame (one run), as the design asks: never against typed-in numbers.
    """
    from benchlib.analysis.compare import trial_values_by
    from benchlib.analysis.stats import ratio_of_medians

    by = list(by)
    rows = records[records["metric"] == metric]
    if rows.empty:
        raise ValueError(f"no rows with metric {metric!r}; metrics present: {sorted(records['metric'].unique())}")
    variants = sorted(rows["variant"].unique())
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} has no {metric!r} rows; {rows['dimension'].iloc[0]}s present: {variants}")
    medians = rows.groupby(by + ["variant"], sort=False)["value"].median().rename("value").reset_index()
    base = medians[medians["variant"] == baseline].drop(columns="variant").rename(columns={"value": "baseline_value"})
    ratios = medians.merge(base, on=by, how="left")
    ratios["ratio"] = ratios["value"] / ratios["baseline_value"]
    samples = trial_values_by(rows, by + ["variant"])
    intervals = []
    for row in ratios.itertuples(index=False):
        key = tuple(getattr(row, name) for name in by)
        own, base = samples[(*key, row.variant)], samples.get((*key, baseline))
        single = base is None or min(own.size, base.size) < 2 or not (base > 0).all()
        interval = None if single else ratio_of_medians(base, own)
        intervals.append((own.min(), own.max(), math.nan if single else interval.ci_low,
                          math.nan if single else interval.ci_high))
    ratios[["low", "high", "ci_low", "ci_high"]] = pd.DataFrame(intervals, index=ratios.index)
    return ratios
