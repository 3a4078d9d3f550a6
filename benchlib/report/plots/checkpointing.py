"""Figures of the checkpointing notebook: peak memory, time and recomputations against the snapshot budget."""

from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from benchlib.engine_names import BENCHLIB_CHECKPOINT, MANUAL
from benchlib.report.plots.common import apply_layout, engine_color, legend_right

MB = 1e6


def budget_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per budget ("sqrt" last): medians of every metric of benchlib-checkpoint, and manual's
    peak and time in the same case, as columns."""
    rows = records.assign(budget=records["params"].map(lambda text: json.loads(text)["budget"]))
    medians = rows.groupby(["budget", "variant", "metric"], sort=False)["value"].median().unstack("metric")
    checkpoint = medians.xs(BENCHLIB_CHECKPOINT, level="variant")
    manual = medians.xs(MANUAL, level="variant")[["peak_bytes", "time"]].add_prefix("manual_")
    table = checkpoint.join(manual).reset_index()
    table["order"] = table["budget"].map(lambda b: float("inf") if b == "sqrt" else float(b))
    table = table.sort_values("order").drop(columns="order").reset_index(drop=True)
    return table.assign(budget=table["budget"].astype(str))  # "2", "5", ..., "sqrt": one type for parquet


def tradeoff_figure(records: pd.DataFrame, *, title: str) -> go.Figure:
    """Three panels over the budget: peak memory (process and tape) against manual's, time against
    manual's, recomputed operations measured against Revolve's prediction."""
    table = budget_table(records)
    x = table["budget"].astype(str)
    color = engine_color(BENCHLIB_CHECKPOINT)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=(
        "peak memory above baseline (MB)", "median time per gradient (s)", "operations recomputed"))
    fig.add_trace(go.Scatter(x=x, y=table["peak_bytes"] / MB, mode="lines+markers", name="process peak (RSS)",
                             line=dict(color=color)), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=table["peak_total_bytes"] / MB, mode="lines+markers", name="tape: saved + gradients",
                             line=dict(color=color, dash="dot"), marker=dict(symbol="diamond")), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=table["manual_peak_bytes"] / MB, mode="lines", name=f"{MANUAL} (stores every z)",
                             line=dict(color=engine_color(MANUAL), dash="dash")), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=table["time"], mode="lines+markers", name=f"{BENCHLIB_CHECKPOINT} time",
                             line=dict(color=color), showlegend=False), row=1, col=2)
    fig.add_trace(go.Scatter(x=x, y=table["manual_time"], mode="lines", line=dict(color=engine_color(MANUAL), dash="dash"),
                             showlegend=False), row=1, col=2)
    fig.add_trace(go.Bar(x=x, y=table["recomputed_nodes"], name="recomputed (measured)", marker_color=color,
                         opacity=0.75), row=1, col=3)
    if "revolve_recomputations" in table:
        fig.add_trace(go.Scatter(x=x, y=table["revolve_recomputations"], mode="markers", name="Revolve's prediction",
                                 marker=dict(symbol="x", size=11, color="#222222")), row=1, col=3)
    fig.update_xaxes(title_text="snapshot budget (sqrt: ~√n evenly spaced)", type="category")
    fig.update_yaxes(rangemode="tozero")
    return legend_right(apply_layout(fig, title=title, height=440))
