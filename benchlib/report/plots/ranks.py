"""What each rank of a step on several ranks holds at its peak, by role, beside one process's: one bar per
process, stacked by role, so sharding (parameters, gradients, optimizer state halved) reads at a glance."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchlib.analysis.ranks import HELD_ROLES, REST
from benchlib.records.metrics import GRADIENT_ROLE, OPTIMIZER_ROLE, PARAMETER_ROLE, SAVED_ROLE
from benchlib.report.plots.common import apply_layout
from benchlib.report.plots.modules import ROLE_COLORS

GATHERED_COLOR = "#f2a541"  # parameters held whole only while their block runs: apart from the sharded ones
COLORS = dict(zip(HELD_ROLES.values(), (ROLE_COLORS[PARAMETER_ROLE], ROLE_COLORS[OPTIMIZER_ROLE],
                                        ROLE_COLORS[GRADIENT_ROLE], ROLE_COLORS[SAVED_ROLE], GATHERED_COLOR)),
              **{REST: "#d9d9d9"})


def held_per_rank(frame: pd.DataFrame, title: str) -> go.Figure:
    """`frame`: `analysis.ranks.held_by_role`'s rows. Horizontal bars, one per process, top to bottom as given."""
    several = frame["case"].nunique() > 1
    labels = [f"{row.case} {row.engine} · {row.process}" if several else f"{row.engine} · {row.process}"
              for row in frame.itertuples()]
    fig = go.Figure()
    for role, color in COLORS.items():
        fig.add_trace(go.Bar(y=labels, x=frame[role], name=role, orientation="h", marker_color=color,
                             hovertemplate="%{y}<br>" + role + ": %{x:.4s}B<extra></extra>"))
    apply_layout(fig, title=title, x_title="bytes held at the step's peak", height=max(320, 60 + 34 * len(labels)))
    fig.update_layout(barmode="stack", yaxis=dict(autorange="reversed"), xaxis=dict(tickformat=".3s", ticksuffix="B"),
                      legend=dict(traceorder="normal"))  # left to right, as the bars stack
    return fig
