"""Shared figure helpers, so every notebook draws an engine in the same colour and layout."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import pandas as pd
import plotly.graph_objects as go

# The engines of docs/architecture.md (and identical_closures' torch variants, drawn in one figure
# with them) get fixed colours; any other name gets a stable one from PALETTE, which shares none of them.
ENGINE_COLORS = {
    "manual": "#4d4d4d",
    "benchlib-inplace": "#1f77b4",
    "benchlib-deferred": "#aec7e8",
    "autograd": "#2ca02c",
    "torch": "#d62728",
    "torch.compile": "#ff7f0e",
    "torch.func": "#9467bd",
}
PALETTE = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f", "#98df8a", "#c5b0d5", "#ffbb78")
TEMPLATE = "plotly_white"


def engine_color(engine: str) -> str:
    """A colour for `engine` that is the same in every figure, notebook and run."""
    if engine in ENGINE_COLORS:
        return ENGINE_COLORS[engine]
    digest = hashlib.sha256(engine.encode("utf-8")).digest()
    return PALETTE[digest[0] % len(PALETTE)]


def engine_colors(engines: Iterable[str]) -> dict[str, str]:
    """`color_discrete_map` for plotly express."""
    return {engine: engine_color(engine) for engine in engines}


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


def ratio_frame(records: pd.DataFrame, *, metric: str, baseline: str, by: Sequence[str] = ("case",)) -> pd.DataFrame:
    """Median over repeats of `metric` per (`by`, engine), divided by the `baseline` engine's median in the same group.

    Ratios are taken within one frame (one run), as the design asks: never against typed-in numbers.
    """
    by = list(by)
    rows = records[records["metric"] == metric]
    if rows.empty:
        raise ValueError(f"no rows with metric {metric!r}; metrics present: {sorted(records['metric'].unique())}")
    engines = sorted(rows["engine"].unique())
    if baseline not in engines:
        raise ValueError(f"baseline engine {baseline!r} has no {metric!r} rows; engines present: {engines}")
    medians = rows.groupby(by + ["engine"], sort=False)["value"].median().rename("value").reset_index()
    base = medians[medians["engine"] == baseline].drop(columns="engine").rename(columns={"value": "baseline_value"})
    ratios = medians.merge(base, on=by, how="left")
    ratios["ratio"] = ratios["value"] / ratios["baseline_value"]
    return ratios


def ratio_bars(
    records: pd.DataFrame,
    *,
    metric: str,
    baseline: str,
    by: str = "case",
    title: str | None = None,
) -> go.Figure:
    """Grouped bars of each engine's `metric` as a multiple of `baseline`'s, one group per `by` value, a line at 1x."""
    ratios = ratio_frame(records, metric=metric, baseline=baseline, by=[by])
    fig = go.Figure()
    for engine, group in ratios.groupby("engine", sort=False):
        fig.add_trace(
            go.Bar(
                name=engine,
                x=group[by].astype(str),
                y=group["ratio"],
                marker_color=engine_color(engine),
                text=[f"{ratio:.2f}x" for ratio in group["ratio"]],
                textposition="outside",
                customdata=group[["value"]],
                hovertemplate=f"{engine}: %{{y:.3f}}x {baseline} (%{{customdata[0]:.4g}})<extra></extra>",
            )
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color=engine_color(baseline), annotation_text=baseline)
    return apply_layout(
        fig,
        title=title or f"{metric} relative to {baseline}",
        x_title=by,
        y_title=f"{metric} / {baseline}",
    ).update_layout(barmode="group")
