"""Figures for identical_closures: allocations and times per protocol step, engine and order."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from benchlib.report.plots.common import apply_layout, engine_color, legend_right, log_axis

# Per phase: allocation column, time column, the columns bounding the time's bar, unit, what the bar is.
PHASE_COLUMNS = {
    "warm": ("warm allocs", "warm time (µs)", ("warm time q25 (µs)", "warm time q75 (µs)"), "µs", "quartiles"),
    "cold": ("cold allocs", "cold time (ms)", ("cold time min (ms)", "cold time max (ms)"), "ms", "range over passes"),
}


def verdict_lines(verdicts: pd.DataFrame, *, mwe: str, phase: str, order: str) -> list[str]:
    """One line per engine: how many step pairs had the same allocations and time, and which differed."""
    rows = verdicts[(verdicts["mwe"] == mwe) & (verdicts["phase"] == phase) & (verdicts["order"] == order)]
    lines = []
    for engine, pairs in rows.groupby("engine", sort=False):
        allocs_same = int((pairs["allocs verdict"] == "same").sum())
        time_same = int((pairs["time verdict"] == "same").sum())
        untested = int((pairs["time verdict"] == "too few samples").sum())
        python = ""
        if "python allocs verdict" in pairs and pairs["python allocs verdict"].notna().any():
            python = f" (Python allocations {int((pairs['python allocs verdict'] == 'same').sum())}/{len(pairs)})"
        text = (f"{engine}: allocations same in {allocs_same}/{len(pairs)} pairs{python}, "
                f"time same in {time_same}/{len(pairs)}")
        if untested:
            text += f" ({untested} too few samples)"
        lines.append(text)
    return lines


def measured_mwes(table: pd.DataFrame) -> list[str]:
    """The MWEs of a `seed_table` with a measured time in some phase: the others were not run (e.g. the
    --budget ran out) or not applicable, and have no figure to draw."""
    times = [columns[1] for columns in PHASE_COLUMNS.values() if columns[1] in table]
    measured = table[times].notna().any(axis=1) if times else pd.Series(False, index=table.index)
    return list(dict.fromkeys(table.loc[measured, "mwe"]))


def steps_figure(table: pd.DataFrame, *, mwe: str, phase: str = "warm", verdicts: pd.DataFrame | None = None) -> go.Figure:
    """Allocations (top: system-allocator calls, then Python-allocator allocations where traced)
    and time (bottom) per step, one column per order, one colour per engine.

    `table` is `benchlib.workloads.closures.seed_table(...)`. A closure "cursed" as in the seed
    shows as a step that stands out from the others of its engine. Log axes, because engines
    differ by orders of magnitude while a curse is a difference within one engine. With
    `verdicts` (`closures.verdict_table(...)`), each column states the verdicts under the plot.
    """
    if phase not in PHASE_COLUMNS:
        raise ValueError(f"phase must be one of {', '.join(PHASE_COLUMNS)}, got {phase!r}")
    allocs, time, (low, high), unit, bar = PHASE_COLUMNS[phase]
    missing = [column for column in ("mwe", "order", "engine", "step", "setup", allocs, time, low, high)
               if column not in table]
    if missing:
        raise ValueError(f"table lacks column(s) {missing}: pass closures.seed_table(frame)")
    rows = table[(table["mwe"] == mwe) & table[time].notna()]
    if rows.empty:
        raise ValueError(f"no measured rows for mwe {mwe!r}; mwes present: {sorted(table['mwe'].unique())}")
    orders = list(dict.fromkeys(rows["order"]))
    python = f"{phase} python allocs"
    # system allocations, Python allocations (CPU, where traced), time: one row each
    panels = [(allocs, "allocations"), *([(python, "Python allocations")] if python in rows and rows[python].notna().any()
                                         else []), (time, None)]
    fig = make_subplots(rows=len(panels), cols=len(orders), shared_xaxes=True, shared_yaxes="rows",
                        column_titles=[f"order: {order}" for order in orders], vertical_spacing=0.06)
    for column, order in enumerate(orders, start=1):
        for engine, group in rows[rows["order"] == order].groupby("engine", sort=False):
            steps = group["step"].astype(str)
            common = dict(name=engine, legendgroup=engine, marker_color=engine_color(engine),
                          mode="lines+markers", showlegend=column == 1)
            for row, (count, what) in enumerate(panels[:-1], start=1):
                fig.add_trace(go.Scatter(x=steps, y=group[count], customdata=group[["setup"]],
                                         hovertemplate=f"%{{x}} (%{{customdata[0]}}): %{{y:.0f}} {what}<extra>"
                                                       f"{engine}</extra>", **(common | {"showlegend": common["showlegend"] and row == 1})),
                              row=row, col=column)
            fig.add_trace(go.Scatter(x=steps, y=group[time], error_y=dict(type="data", array=group[high] - group[time],
                                                                 arrayminus=group[time] - group[low]),
                                     customdata=group[["setup"]],
                                     hovertemplate=f"%{{x}} (%{{customdata[0]}}): %{{y:.4g}} {unit}<extra>"
                                                   f"{engine}</extra>",
                                     **(common | {"showlegend": False})), row=len(panels), col=column)
    for row, (column_name, what) in enumerate(panels, start=1):
        log_axis(fig, rows[column_name], row=row)
        fig.update_yaxes(title_text=f"{phase} {what} per train()" if what else
                         f"{phase} time per train() ({unit}; bars: {bar})", row=row, col=1)
    height = 320 * len(panels)
    apply_layout(fig, title=f"identical_closures, {mwe} MWE, {phase}: allocations and time per step", height=height)
    legend_right(fig)
    if verdicts is not None:
        notes = [verdict_lines(verdicts, mwe=mwe, phase=phase, order=order) for order in orders]
        for column, lines in enumerate(notes):
            fig.add_annotation(text="<br>".join(lines) or "no verdicts", xref="paper", yref="paper", showarrow=False,
                               x=column / len(orders), y=0, yshift=-36, xanchor="left", yanchor="top", align="left",
                               font=dict(size=11))
        fig.update_layout(height=height + 16 * max(len(lines) for lines in notes), margin=dict(b=56 + 16 * max(len(n) for n in notes)))
    return fig
