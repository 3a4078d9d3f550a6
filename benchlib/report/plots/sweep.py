"""Figures of a parameter grid: a measured metric against the grid's parameters, from the merged records."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go

from benchlib.report.plots.common import apply_layout, engine_color, legend_right

# The headline metrics a grid figure is drawn for, with their label and scale.
GRID_METRICS = {"peak_bytes": ("peak memory above baseline (MB)", 1e-6), "time": ("median time (s)", 1.0)}


def grid_frame(records: pd.DataFrame, *, metric: str) -> pd.DataFrame:
    """Median of `metric` per engine and grid point, the point's values as columns (from params["grid"])."""
    rows = records[records["metric"] == metric]
    if rows.empty:
        raise ValueError(f"no {metric!r} records; metrics present: {sorted(records['metric'].unique())}")
    points = rows["params"].map(lambda text: json.loads(text).get("grid", {}) if text else {})
    if not points.map(bool).any():
        raise ValueError("the records carry no grid point (params['grid']): were they made by a --grid run?")
    expanded = pd.DataFrame(list(points), index=rows.index)
    frame = pd.concat([rows[["variant", "case", "value"]], expanded], axis=1)
    keys = ["variant", *expanded.columns]
    return frame.groupby(keys, sort=True, dropna=False)["value"].median().reset_index()


def grid_figure(records: pd.DataFrame, *, metric: str, grid: Mapping[str, Sequence] | None = None) -> go.Figure:
    """`metric` against the first grid parameter, one line per engine and value of the other parameters."""
    frame = grid_frame(records, metric=metric)
    axes = [name for name in (grid or {}) if name in frame] or [c for c in frame.columns if c not in ("variant", "value")]
    x_name, others = axes[0], axes[1:]
    label, scale = GRID_METRICS.get(metric, (metric, 1.0))
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot", "longdash"]
    groups = frame.groupby(["variant", *others], sort=False) if others else frame.groupby(["variant"], sort=False)
    # One dash per combination of the other parameters, the same for every engine (colour = engine).
    combinations = sorted({tuple(key[1:]) if isinstance(key, tuple) else () for key, _ in groups}, key=str)
    dash_of = {combination: dashes[i % len(dashes)] for i, combination in enumerate(combinations)}
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        engine, rest = key[0], tuple(key[1:])
        name = engine + "".join(f", {n}={v}" for n, v in zip(others, rest))
        dash = dash_of[rest]
        x = group[x_name].astype(str) if group[x_name].dtype == object else group[x_name]
        fig.add_trace(go.Scatter(x=x, y=group["value"] * scale, mode="lines+markers", name=name,
                                 line=dict(color=engine_color(engine), dash=dash)))
    benchmark = ", ".join(sorted(records["benchmark"].unique()))
    apply_layout(fig, title=f"{benchmark}: {label} against {x_name} (median per grid point)", x_title=x_name, y_title=label)
    return legend_right(fig)
