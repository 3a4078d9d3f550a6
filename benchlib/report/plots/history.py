"""The figure of `benchlib history`: one series over its runs, where it stepped and by how much."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from benchlib.report.plots.common import apply_layout
from benchlib.units import unit_scale
from benchlib.analysis.stats import WORSE

POINT_COLOR, TRIAL_COLOR, LEVEL_COLOR = "#1f77b4", "#9e9e9e", "#555555"
STEP_COLORS = {WORSE: "#b42318"}  # a regression in red, an improvement in green
BETTER_COLOR = "#1a7f37"


def _run_label(row: pd.Series) -> str:
    """The x label of a run: the commit it measured, then when it started (date and time: runs of one day)."""
    started = pd.Timestamp(row["started"]).strftime("%Y-%m-%d %H:%M") if pd.notna(row["started"]) else "?"
    return f"{row['commit'] or '?'}<br>{started}"


def step_figure(points: pd.DataFrame, steps: pd.DataFrame, *, name: str, by: str = "commit") -> go.Figure:
    """Did this figure step, and is the step larger than its runs' trial spread? Each run's trials
    (grey) and median (blue, bar: the trials' range), the level of each segment between steps (the
    median of its pooled trials), and a dashed line where it stepped, labelled with the ratio; the runs
    in the order `by` (commit or time) put them."""
    points = points.sort_values("position")
    first = points.iloc[0]
    unit = first["unit"]
    factor, unit_name = unit_scale(float(np.median(points["median"])), unit)
    medians = points["median"].to_numpy(float) / factor
    low = np.array([np.min(trials) for trials in points["trials"]]) / factor
    high = np.array([np.max(trials) for trials in points["trials"]]) / factor
    fig = go.Figure()
    trial_x = np.concatenate([[position] * len(trials) for position, trials in zip(points["position"], points["trials"])])
    fig.add_trace(go.Scatter(x=trial_x, y=np.concatenate(points["trials"].tolist()) / factor, mode="markers",
                             name="trials", marker=dict(color=TRIAL_COLOR, size=6, symbol="circle-open"),
                             hovertemplate=f"trial: %{{y:.4g}} {unit_name}<extra></extra>"))
    fig.add_trace(go.Scatter(
        x=points["position"], y=medians, mode="markers+lines", name="median of the run's trials",
        marker=dict(color=POINT_COLOR, size=9), line=dict(color=POINT_COLOR, width=1),
        error_y=dict(type="data", array=high - medians, arrayminus=medians - low, color=POINT_COLOR, thickness=1),
        customdata=np.stack([points["run_id"], points["commit"].fillna("?")], axis=1),
        hovertemplate=f"run %{{customdata[0]}}<br>commit %{{customdata[1]}}<br>median %{{y:.4g}} {unit_name}"
                      "<extra></extra>"))
    bounds = [0, *sorted(int(at) for at in steps["position"]), len(points)]
    for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
        level = float(np.median(np.concatenate(points["trials"].iloc[start:end].tolist()))) / factor
        fig.add_trace(go.Scatter(x=[start - 0.4, end - 0.6], y=[level, level], mode="lines", showlegend=index == 0,
                                 name="level between steps (median of pooled trials)",
                                 line=dict(color=LEVEL_COLOR, width=2, dash="dot"), hoverinfo="skip"))
    for step in steps.itertuples():
        color = STEP_COLORS.get(step.label, BETTER_COLOR)
        fig.add_vline(x=step.position - 0.5, line=dict(color=color, dash="dash", width=2))
        fig.add_annotation(x=step.position - 0.5, y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           font=dict(color=color), text=f"{step.ratio:.3g}x [{step.ci_low:.3g}, {step.ci_high:.3g}] "
                                                        f"{step.label} at {step.to_commit or step.to_run}")
    apply_layout(fig, title=f"{name} ({first['device']}, {first['dtype']}) over {len(points)} runs",
                 x_title=f"run (commit, start time), in {by} order", y_title=f"{first['metric']} ({unit_name or 'value'})",
                 height=460)
    fig.update_yaxes(rangemode="tozero")  # a step reads at its true size against zero
    fig.update_xaxes(tickmode="array", tickvals=points["position"].tolist(),
                     ticktext=[_run_label(row) for _, row in points.iterrows()])
    # the legend under the axis title: above the plot, the steps' labels sit
    return fig.update_layout(margin=dict(t=90, b=120), legend=dict(yanchor="top", y=-0.3))
