"""Figures of the gradient-engine notebooks (dot_chain, rnn_fanout): the pictures of autograd #219.

Each builder takes tidy frames (records as `records_frame` gives them, timelines as
`EngineComparison.timelines`: case, engine, t_s, bytes, phase) and returns a plotly figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from benchlib.engine_names import MANUAL, MANUAL_SEED
from benchlib.report.plots.common import apply_layout, engine_color, legend_right, log_axis, ratio_frame
from benchlib.units import format_bytes

MB = 1e6
LOG_SPREAD = 20  # a panel whose values span more than this factor is drawn on a log axis
PHASE_SYMBOLS = {"forward": "circle-open", "backward": "diamond"}
STATUS_METRICS = ("failed", "not_applicable")


def _one_case(frame: pd.DataFrame, case: str | None, what: str) -> pd.DataFrame:
    cases = list(dict.fromkeys(frame["case"]))
    if case is None:
        if len(cases) != 1:
            raise ValueError(f"{what} holds cases {cases}; pass case= one of them")
        return frame
    if case not in cases:
        raise ValueError(f"case {case!r} is not in {what}; valid cases: {cases}")
    return frame[frame["case"] == case]


NOTE_WIDTH = 170  # characters of a status note per line under a figure (11 px type across 1400 px)


def _status_notes(records: pd.DataFrame, case: str | None = None) -> list[str]:
    """'engine: not applicable (reason)' for every engine that has no measurement, folded at words onto at most two
    lines (the report's tables hold the whole reason)."""
    import textwrap

    rows = records[records["metric"].isin(STATUS_METRICS)]
    if case is not None:
        rows = rows[rows["case"] == case]
    notes = []
    for row in rows.itertuples():
        message = json.loads(row.params).get("message", "")
        where = f" at {row.case}" if case is None and records["case"].nunique() > 1 else ""  # a sweep's notes
        text = f"{row.variant}{where}: {row.metric.replace('_', ' ')} ({message.splitlines()[0] if message else ''})"
        notes += textwrap.wrap(text, NOTE_WIDTH, subsequent_indent="    ", max_lines=2, placeholder=" ...)")
    return notes


def _annotate(fig: go.Figure, notes: Sequence[str]) -> go.Figure:
    if notes:
        # below the x axis title at any figure height: pixels, not a share of the plot
        fig.add_annotation(text="<br>".join(notes), xref="paper", yref="paper", x=0, y=0, yanchor="top",
                           yshift=-58, showarrow=False, align="left", font=dict(size=11))
        fig.update_layout(margin=dict(b=76 + 16 * len(notes)))
    return fig


ZOOM_SPREAD = 4.0  # engines whose peaks differ by more than this factor get a zoomed second panel


def split_calls(samples: pd.DataFrame) -> pd.DataFrame:
    """Number each gradient call in one engine's samples (a new call begins where 'forward' begins
    again) and re-zero its time, so repeats are drawn over each other rather than end to end."""
    forward_starts = samples["phase"].eq("forward") & samples["phase"].shift().ne("forward")
    call = forward_starts.cumsum().clip(lower=1)
    t0 = samples.groupby(call)["t_s"].transform("min")
    return samples.assign(call=call.to_numpy(), t_call_s=(samples["t_s"] - t0).to_numpy())


def _engine_lines(fig: go.Figure, frame: pd.DataFrame, *, row: int, showlegend: bool) -> None:
    for engine, samples in frame.groupby("engine", sort=False):
        color = engine_color(engine)
        calls = split_calls(samples)
        last = int(calls["call"].max())
        for call, one in calls.groupby("call", sort=True):
            fig.add_trace(go.Scatter(
                x=one["t_call_s"], y=one["bytes"] / MB, mode="lines", name=engine, legendgroup=engine,
                showlegend=bool(showlegend and call == last), opacity=1.0 if call == last else 0.45,
                line=dict(color=color, width=2 if call == last else 1),
                hovertemplate=f"{engine}, call {call}<br>%{{x:.3f}} s, %{{y:.1f}} MB<extra></extra>"), row=row, col=1)
            starts = one[one["phase"].ne(one["phase"].shift()) & one["phase"].ne("")]
            if call == last:
                fig.add_trace(go.Scatter(
                    x=starts["t_call_s"], y=starts["bytes"] / MB, mode="markers", legendgroup=engine, showlegend=False,
                    marker=dict(color=color, size=10, symbol=[PHASE_SYMBOLS.get(p, "x") for p in starts["phase"]]),
                    text=starts["phase"], hovertemplate=f"{engine}: %{{text}} begins at %{{x:.3f}} s<extra></extra>"),
                    row=row, col=1)


def memory_timelines(timelines: pd.DataFrame, *, case: str | None = None, records: pd.DataFrame | None = None,
                     title: str = "Memory above baseline during one gradient call") -> go.Figure:
    """Memory over time for every engine, each call from its own start (repeats drawn faintly
    under the last); a marker where each phase of the last call begins.

    A longer line is a slower engine, a higher one holds more memory. When one engine's peak is
    far above the others (deferred accumulation on the RNN), a second panel zooms on the rest.
    """
    frame = _one_case(timelines, case, "the timelines")
    peaks = frame.groupby("engine", sort=False)["bytes"].max().clip(lower=1)
    low = peaks[peaks <= peaks.min() * ZOOM_SPREAD]
    zoom = len(low) < len(peaks) and len(low) > 1
    fig = make_subplots(rows=2 if zoom else 1, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("all engines", f"zoom: {', '.join(low.index)}") if zoom else None)
    _engine_lines(fig, frame, row=1, showlegend=True)
    if zoom:
        _engine_lines(fig, frame[frame["engine"].isin(low.index)], row=2, showlegend=False)
        fig.update_yaxes(title_text="MB above baseline", row=2, col=1)
    apply_layout(fig, title=f"{title} ({case})" if case else title, height=640 if zoom else 420)
    if zoom:  # the panels' titles sit where the legend goes: the legend moves right
        legend_right(fig)
    fig.update_yaxes(title_text="memory above baseline (MB)", row=1, col=1)
    fig.update_xaxes(title_text="time since the call began (s)", row=2 if zoom else 1, col=1)
    notes = ["markers: ○ forward begins, ◇ backward begins (last call); faint lines: earlier calls"]
    if records is not None:
        notes += _status_notes(records, case)
    return _annotate(fig, notes)


def peak_bars(records: pd.DataFrame, *, case: str | None = None, baseline: str = MANUAL,
              title: str = "Peak memory above baseline") -> go.Figure:
    """Peak memory per engine in MB (median over trials, error bars the trials' min and max), each bar
    labelled with its ratio to `baseline`, named beside it, and, with two or more trials a side, the ratio's 95% interval."""
    records = _one_case(records, case, "the records")
    ratios = ratio_frame(records, metric="peak_bytes", baseline=baseline)
    fig = go.Figure()
    for row in ratios.itertuples():
        interval = "" if math.isnan(row.ci_low) else f"<br>[{row.ci_low:.3f}, {row.ci_high:.3f}]"
        fig.add_trace(go.Bar(x=[row.variant], y=[row.value / MB], name=row.variant, marker_color=engine_color(row.variant),
                             error_y=dict(type="data", symmetric=False, array=[(row.high - row.value) / MB],
                                          arrayminus=[(row.value - row.low) / MB], color="#444444"),
                             text=[f"{format_bytes(int(row.value))}<br>{row.ratio:.3f}x {baseline}{interval}"], textposition="outside",
                             hovertemplate=f"{row.variant}: %{{y:.1f}} MB, {row.ratio:.3f}x {baseline}<extra></extra>"))
    apply_layout(fig, title=f"{title} ({case})" if case else title, x_title="engine",
                 y_title="peak above baseline (MB)")
    fig.update_layout(showlegend=False)
    fig.update_yaxes(rangemode="tozero")
    return _annotate(fig, _status_notes(records, case))


ROLES = (  # (column, legend, colour): the stack of `peak_by_role`, bottom to top
    ("saved", "forward values saved for backward", "#4c78a8"),
    ("gradients", "gradient buffers", "#f58518"),
    ("other", "other: temporaries, allocator, unexposed", "#bab0ac"),
)
ROLE_SOURCES = {"benchlib": "exact, from the tape at its peak", "torch": "saved tensors packed by autograd (hooks)"}


def role_frame(records: pd.DataFrame, *, case: str | None = None) -> pd.DataFrame:
    """Per engine, medians over trials of the measured peak and of its known roles (`role_saved_bytes`,
    `role_gradient_bytes`, 0 where the engine exposes none), and `other`: the peak minus both, never
    below 0; `source` says where the roles come from."""
    records = _one_case(records, case, "the records")
    metrics = ["peak_bytes", "role_saved_bytes", "role_gradient_bytes"]
    medians = (records[records["metric"].isin(metrics)].groupby(["variant", "metric"], sort=False)["value"]
               .median().unstack("metric").reindex(columns=metrics))
    table = pd.DataFrame({"peak": medians["peak_bytes"], "saved": medians["role_saved_bytes"].fillna(0.0),
                          "gradients": medians["role_gradient_bytes"].fillna(0.0)})
    table["other"] = (table["peak"] - table["saved"] - table["gradients"]).clip(lower=0.0)
    table["source"] = np.where(medians["role_gradient_bytes"].notna(), ROLE_SOURCES["benchlib"],
                               np.where(medians["role_saved_bytes"].notna(), ROLE_SOURCES["torch"], "none exposed"))
    return table.rename_axis("engine").reset_index()


def peak_by_role(records: pd.DataFrame, *, case: str | None = None,
                 title: str = "Peak memory by role") -> go.Figure:
    """Each engine's peak (median over trials) stacked by role: what it saved from the forward pass,
    its gradient buffers (both exact for benchlib's engines; saved tensors for torch's) and the
    rest of the measured peak; a diamond marks the measured peak where the known roles exceed it."""
    table = role_frame(records, case=case)
    fig = go.Figure()
    for column, legend, color in ROLES:
        fig.add_trace(go.Bar(x=table["engine"], y=table[column] / MB, name=legend, marker_color=color,
                             customdata=table["source"],
                             hovertemplate=f"%{{x}}: {legend} %{{y:.1f}} MB<br>%{{customdata}}<extra></extra>"))
    over = table[table["saved"] + table["gradients"] > table["peak"]]
    if not over.empty:
        fig.add_trace(go.Scatter(x=over["engine"], y=over["peak"] / MB, mode="markers", name="measured peak",
                                 marker=dict(symbol="diamond", size=11, color="#222222")))
    apply_layout(fig, title=f"{title} ({case})" if case else title, x_title="engine",
                 y_title="peak above baseline (MB)")
    fig.update_layout(barmode="stack")
    legend_right(fig)
    return _annotate(fig, _status_notes(records, case))


def role_timelines(frame: pd.DataFrame, *, case: str | None = None, order: Sequence[str] = (),
                   title: str = "Memory by role during one gradient call") -> go.Figure:
    """One panel per engine that exposes roles: what it holds by role over one call (stacked
    areas; the tape's live counters, or torch's saved tensors) and, drawn over them, what the
    allocator holds above the level before the call (process RSS on CPU, CUDA's allocated bytes),
    sampled at the same instants. The gap between the line and the stack is everything else.
    Panels follow `order` (e.g. the notebook's engine list), then the other engines by name."""
    if frame.empty:  # e.g. only manual and autograd ran: say so in the figure, do not stop the notebook
        fig = apply_layout(go.Figure(), title=title)
        fig.add_annotation(text=f"no engine that exposes roles ran ({MANUAL}, {MANUAL_SEED} and HIPS autograd expose none)",
                           xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
        return fig
    frame = _one_case(frame, case, "the role timelines")
    present = set(frame["engine"])
    engines = [e for e in order if e in present] + sorted(present - set(order))
    cuda = "device" in frame and frame["device"].astype(str).str.startswith("cuda").any()
    allocator = "CUDA allocated" if cuda else "process RSS"
    fig = make_subplots(rows=len(engines), cols=1, subplot_titles=engines, vertical_spacing=0.3 / len(engines))
    in_legend = set()
    for row, engine in enumerate(engines, start=1):
        samples = frame[frame["engine"] == engine]
        for column, legend, color in ROLES[:2]:
            if samples[column].notna().any():
                fig.add_trace(go.Scatter(x=samples["t_s"], y=samples[column] / MB, mode="lines", name=legend,
                                         stackgroup=f"roles{row}", line=dict(color=color, width=0.5), fillcolor=color,
                                         legendgroup=column, showlegend=column not in in_legend,
                                         hovertemplate=f"{engine}: {legend} %{{y:.1f}} MB at %{{x:.3f}} s<extra></extra>"),
                              row=row, col=1)
                in_legend.add(column)
        fig.add_trace(go.Scatter(x=samples["t_s"], y=samples["bytes"] / MB, mode="lines", name=f"{allocator} above baseline",
                                 line=dict(color="#222222", width=2), legendgroup="allocator", showlegend=row == 1,
                                 hovertemplate=f"{engine}: {allocator} %{{y:.1f}} MB at %{{x:.3f}} s<extra></extra>"),
                      row=row, col=1)
        fig.update_yaxes(title_text="MB", rangemode="tozero", row=row, col=1)
    apply_layout(fig, title=f"{title} ({case})" if case else title, height=150 + 190 * len(engines))
    fig.update_xaxes(exponentformat="none")  # every panel's ticks alike (plotly chose "100µ" for some, decimals for others)
    fig.update_xaxes(title_text="time since the call began (s)", row=len(engines), col=1)
    legend_right(fig)
    return _annotate(fig, ["first trial: the measured call where it is one and the gauge passive (benchlib's tape), "
                           "else one more call after the measured ones (torch's saved-tensor hooks); engines that expose no roles "
                           f"({MANUAL}, {MANUAL_SEED}, HIPS autograd) are not drawn", f"gap between the {allocator} line and the "
                           "stack: temporaries, allocator slack, and what an engine does not expose"])


def sweep_lines(records: pd.DataFrame, *, parameter: str = "T",
                title: str = "Peak memory and time against the number of steps") -> go.Figure:
    """Peak memory and median time against a swept case parameter (read from params), one line per engine."""
    measured = records[records["metric"].isin(["peak_bytes", "time"])]
    if measured.empty:
        raise ValueError("no peak_bytes or time records to plot")
    values = measured["params"].map(lambda text: json.loads(text).get(parameter))
    if values.isna().any():
        raise ValueError(f"parameter {parameter!r} is missing from some records' params")
    table = (measured.assign(**{parameter: values})
             .groupby(["variant", parameter, "metric"], sort=False)["value"].median().unstack("metric").reset_index()
             .sort_values(parameter))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("peak memory above baseline (MB)", "median time (s)"))
    for engine in dict.fromkeys(measured["variant"]):
        rows = table[table["variant"] == engine]
        color = engine_color(engine)
        for col, metric, scale in ((1, "peak_bytes", MB), (2, "time", 1.0)):
            if metric in rows:
                fig.add_trace(go.Scatter(x=rows[parameter], y=rows[metric] / scale, mode="lines+markers", name=engine,
                                         legendgroup=engine, showlegend=col == 1, line=dict(color=color)),
                              row=1, col=col)
    legend_right(apply_layout(fig, title=title))
    fig.update_xaxes(title_text=parameter)
    times = table["time"].dropna() if "time" in table else pd.Series(dtype=float)
    if len(times) and times[times > 0].max() > LOG_SPREAD * times[times > 0].min():  # one slow engine flattens the rest
        log_axis(fig, times, row=1, col=2)
        fig.layout.annotations[1].text = "median time (s, log)"
    return _annotate(fig, _status_notes(records))
