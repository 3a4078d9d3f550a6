"""Memory by module path as an icicle per engine: the model's tree left to right, each module's bytes split
by role at the leaves, one engine shown at a time (the menu picks it)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from benchlib.analysis.module_paths import path_levels
from benchlib.analysis.modules import ROLE_WORDS
from benchlib.records.metrics import GRADIENT_ROLE, OPTIMIZER_ROLE, PARAMETER_ROLE, SAVED_ROLE
from benchlib.report.plots.common import apply_layout

ROLE_COLORS = {PARAMETER_ROLE: "#9ecae9", OPTIMIZER_ROLE: "#c6dbef", SAVED_ROLE: "#e45756", GRADIENT_ROLE: "#4c78a8"}
MODULE_COLOR = "#eeeeee"


def _tree(rows: pd.DataFrame, top: str) -> dict[str, list]:
    """ids, labels, parents, values and colours of one engine's icicle: modules by level (each labelled by the
    part of its path below its parent), roles as leaves; a node's value is the sum of the leaves below it."""
    nodes: dict[str, list] = {top: [top, "", 0.0, MODULE_COLOR]}  # id -> label, parent, value, colour
    for row in rows.itertuples():
        parent, above = top, ""
        for level in path_levels(row.module):
            node = f"{top}/{level}"
            nodes.setdefault(node, [level[len(above) + 1:] if above else level, parent, 0.0, MODULE_COLOR])
            parent, above = node, level
        nodes[f"{parent}//{row.role}"] = [ROLE_WORDS.get(row.role, row.role), parent, 0.0,
                                          ROLE_COLORS.get(row.role, MODULE_COLOR)]
        node = f"{parent}//{row.role}"
        while node:  # the leaf's bytes count in every node above it
            nodes[node][2] += float(row.bytes)
            node = nodes[node][1]
    ids = list(nodes)
    return {"ids": ids, "labels": [nodes[i][0] for i in ids], "parents": [nodes[i][1] for i in ids],
            "values": [nodes[i][2] for i in ids], "colors": [nodes[i][3] for i in ids]}


def memory_by_module(table: pd.DataFrame, title: str) -> go.Figure:
    """`table`: `analysis.modules.module_table`'s rows (case, engine, module, role, bytes). One icicle per
    (case, engine), the first shown; hovering gives bytes and the share of the engine's total."""
    fig = go.Figure()
    keys = list(dict.fromkeys(zip(table["case"], table["engine"])))
    several = len({case for case, _ in keys}) > 1
    for index, (case, engine) in enumerate(keys):
        rows = table[(table["case"] == case) & (table["engine"] == engine) & (table["bytes"] > 0)]
        top = f"{case} {engine}" if several else engine
        tree = _tree(rows, top)
        fig.add_trace(go.Icicle(ids=tree["ids"], labels=tree["labels"], parents=tree["parents"], values=tree["values"],
                                branchvalues="total", marker=dict(colors=tree["colors"]), visible=index == 0,
                                name=top, maxdepth=-1, sort=True,
                                texttemplate="%{label}<br>%{value:.3s}B",
                                hovertemplate="%{id}<br>%{value:.4s}B, %{percentRoot:.1%} of this engine's"
                                              "<extra></extra>"))
    buttons = [dict(label=trace.name, method="update",
                    args=[{"visible": [other is trace for other in fig.data]}]) for trace in fig.data]
    apply_layout(fig, title=title, height=560)
    fig.update_layout(updatemenus=[dict(buttons=buttons, direction="down", x=1.0, xanchor="right", y=1.12,
                                        yanchor="bottom", showactive=True)] if len(buttons) > 1 else [],
                      margin=dict(l=10, r=10, t=90, b=10))
    return fig
