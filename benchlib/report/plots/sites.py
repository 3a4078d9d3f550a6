"""The attribution pass's figure: bytes at the peak by source line, engines side by side."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchlib.report.plots.common import apply_layout, engine_color

SHOWN_SITES = 10


def site_name(row) -> str:
    """A bar's label: `model.py:16 forward` (a line's primitive can differ between engines: the tables name it)."""
    return f"{row['site']} {row['function']}"


def peak_sites_figure(sites: pd.DataFrame, *, title: str, kind: str = "peak", shown: int = SHOWN_SITES) -> go.Figure:
    """Horizontal grouped bars of one case's sites (a `site_table` of one case): the `shown` sites holding
    the most bytes under any engine, the user's own lines on top, one bar per engine (`variant`)."""
    rows = sites[sites["kind"] == kind].copy()
    rows["label"] = [site_name(row) for _, row in rows.iterrows()]
    ranked = rows.groupby("label").agg(bytes=("bytes", "max"), own=("own", "max"))
    ranked = ranked.sort_values(["own", "bytes"], ascending=[False, False]).head(shown)
    order = list(reversed(ranked.index))  # plotly draws the first category at the bottom
    fig = go.Figure()
    for engine, group in rows[rows["label"].isin(order)].groupby("variant", sort=False):
        by_label = group.groupby("label")["bytes"].sum().reindex(order)
        fig.add_bar(y=order, x=by_label.fillna(0).to_numpy(), name=engine, orientation="h",
                    marker_color=engine_color(engine),
                    hovertemplate="%{y}<br>" + engine + ": %{x:.4s}B<extra></extra>")
    what = {"peak": "bytes live at the peak", "temporary": "bytes freed soon after", "allocated": "bytes allocated"}[kind]
    apply_layout(fig, title=title, x_title=f"{what} (decimal units)", height=max(360, 60 + 34 * len(order)))
    fig.update_layout(barmode="group", margin=dict(l=20, r=20, t=90, b=50))
    fig.update_xaxes(tickformat="~s", ticksuffix="B")
    fig.update_yaxes(automargin=True, categoryorder="array", categoryarray=order)
    return fig
