"""Figures of a model file's run (`benchlib run my_model.py`): peak per engine with its interval, memory by role.

Both take the run's records frame; several versions of one file (one case each) are drawn side by side.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from benchlib.engine_names import COMBINED
from benchlib.analysis.compare import trial_values
from benchlib.report.plots.common import apply_layout, engine_color
from benchlib.report.plots.gradients import MB, _annotate, _status_notes

GB = 1e9
from benchlib.analysis.stats import median_interval

VERSION_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9d755d", "#e45756")
# Bottom to top: what the model holds before the step (the baseline), then the step's peak by role.
ROLES = (("role_parameter_bytes", "parameters (held before the step)", "#9ecae9"),
         ("role_optimizer_bytes", "optimizer state (held before the step)", "#c6dbef"),
         ("role_saved_bytes", "saved activations", "#e45756"),
         ("role_gradient_bytes", "gradients", "#4c78a8"),
         ("other", "rest of the step's peak", "#bab0ac"))


def _x(frame: pd.DataFrame, several: bool) -> list:
    """Engines on the x axis (a combination one technique a line), grouped under their version when there are
    several."""
    engines = [_lines(engine) for engine in frame["engine"]]
    return [frame["case"].tolist(), engines] if several else engines


def _lines(engine: str) -> str:
    return engine.replace(COMBINED, f"{COMBINED}<br>")


def _whose(records: pd.DataFrame) -> str:
    """The model and device a figure shows, for its title ("my_mlp on cpu: ...")."""
    names = ", ".join(dict.fromkeys(map(str, records["benchmark"].dropna()))) if "benchmark" in records else ""
    devices = ", ".join(dict.fromkeys(map(str, records["device"].dropna()))) if "device" in records else ""
    return f"{names or 'model'}{f' on {devices}' if devices else ''}: "


def _notes(records: pd.DataFrame) -> list[str]:
    """Why an engine has no bar, each line naming its version when there are several."""
    cases = list(dict.fromkeys(records["case"]))
    if len(cases) == 1:
        return _status_notes(records)
    return [f"{case} {note}" for case in cases for note in _status_notes(records, case)]


def peak_frame(records: pd.DataFrame) -> pd.DataFrame:
    """Per version (case) and engine: the median peak above the baseline over trials with its 95% interval."""
    rows = []
    peaks = records[records["metric"] == "peak_bytes"]
    for (case, engine), group in peaks.groupby(["case", "variant"], sort=False):
        values = trial_values(group)
        interval = median_interval(values) if values.size > 1 else None
        rows.append({"case": case, "engine": engine, "peak": float(np.median(values)), "trials": int(values.size),
                     "low": interval.ci_low if interval else np.nan, "high": interval.ci_high if interval else np.nan})
    return pd.DataFrame(rows, columns=["case", "engine", "peak", "trials", "low", "high"])


def peak_intervals(records: pd.DataFrame) -> go.Figure:
    """Which engine (and version) peaks lowest, and is the difference larger than the trials' spread?"""
    table = peak_frame(records)
    several = table["case"].nunique() > 1
    fig = go.Figure()
    groups = table.groupby("case", sort=False) if several else [(None, table)]
    for index, (case, part) in enumerate(groups):
        fig.add_trace(go.Bar(
            x=part["engine"], y=part["peak"] / MB, name=case or "median over trials", showlegend=several,
            marker_color=VERSION_COLORS[index % len(VERSION_COLORS)] if several else [engine_color(e) for e in part["engine"]],
            error_y=dict(type="data", array=(part["high"] - part["peak"]) / MB,
                         arrayminus=(part["peak"] - part["low"]) / MB),
            customdata=part["trials"], hovertemplate="%{x}: %{y:.2f} MB over %{customdata} trials<extra></extra>"))
    apply_layout(fig, title=_whose(records) + "peak memory of one step above the baseline (median, 95% interval over trials)",
                 x_title="engine", y_title="peak above baseline (MB)")
    fig.update_layout(barmode="group", legend_title_text="version" if several else None)
    return _annotate(fig, _notes(records))


def role_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per version and engine, medians over trials of each role's bytes and `other`: the peak minus the
    step's measured roles, never below 0."""
    metrics = ["peak_bytes", *(metric for metric, _, _ in ROLES if metric != "other")]
    medians = (records[records["metric"].isin(metrics)].groupby(["case", "variant", "metric"], sort=False)["value"]
               .median().unstack("metric").reindex(columns=metrics).fillna(0.0))
    medians["other"] = (medians["peak_bytes"] - medians["role_saved_bytes"] - medians["role_gradient_bytes"]).clip(lower=0.0)
    return medians.rename_axis(["case", "engine"]).reset_index()


def memory_by_role(records: pd.DataFrame) -> go.Figure:
    """Where a step's memory goes, per engine: what the model holds before it, then its peak by role."""
    table = role_table(records)
    several = table["case"].nunique() > 1
    fig = go.Figure()
    for metric, legend, color in ROLES:
        fig.add_trace(go.Bar(x=_x(table, several), y=table[metric] / MB, name=legend, marker_color=color,
                             hovertemplate=f"{legend}: %{{y:.2f}} MB<extra></extra>"))
    apply_layout(fig, title=_whose(records) + "memory of one step by role (median over trials)", x_title="engine",
                 y_title="memory (MB)")
    fig.update_layout(barmode="stack")
    return _annotate(fig, _notes(records))


def frontier(records: pd.DataFrame) -> go.Figure:
    """Which engine gets the step under a memory level, and what does it cost in time? Each engine's peak
    against its time per step, both medians with 95% intervals over trials; the frontier engines (no other
    beats them on both) filled and joined, the others hollow, those whose gradient could not be checked grey."""
    from benchlib.analysis.frontier import TRACKED, frontier_frame

    table = frontier_frame(records)
    several = table["case"].nunique() > 1
    right = np.nanmax(np.fmax(table["time_high"].to_numpy(float), table["time"].to_numpy(float))) if len(table) else 1.0
    fig = go.Figure()
    for index, (case, part) in enumerate(table.groupby("case", sort=False)):
        line = part[part["pareto"]].sort_values("peak")
        color = VERSION_COLORS[index % len(VERSION_COLORS)]
        if len(line) > 1:
            fig.add_trace(go.Scatter(x=line["time"] * 1e3, y=line["peak"] / MB, mode="lines", line=dict(
                color=color if several else "#bbbbbb", dash="dot", shape="hv"), name=f"{case} frontier" if several
                else "frontier", hoverinfo="skip"))
        for row in part.itertuples():
            marker_color = engine_color(row.engine) if row.checked else "#9e9e9e"
            label = row.engine + ("" if row.checked else " (gradient not checked)")
            fig.add_trace(go.Scatter(  # the answer's engines are named on the plot, every engine in the legend
                x=[row.time * 1e3], y=[row.peak / MB], mode="markers+text" if row.pareto else "markers",
                # a combination's name one technique a line; names of points on the right half read leftwards
                text=[_lines(row.engine)],
                textposition="top left" if row.time > right / 2 else "top right",
                name=f"{case}: {label}" if several else label,
                marker=dict(size=12, color=marker_color if row.pareto else "white",
                            line=dict(color=marker_color, width=2), symbol="circle" if row.checked else "x"),
                error_x=dict(type="data", array=[_half(row.time_high, row.time) * 1e3],
                             arrayminus=[_half(row.time, row.time_low) * 1e3], color=marker_color),
                error_y=dict(type="data", array=[_half(row.peak_high, row.peak) / MB],
                             arrayminus=[_half(row.peak, row.peak_low) / MB], color=marker_color),
                hovertemplate=(f"{label}: %{{y:.3f}} MB at %{{x:.2f}} ms/step over {row.trials} trials"
                               f"{' (frontier)' if row.pareto else ''}<extra></extra>")))
    which = "tracked" if (table["peak_metric"] == TRACKED).any() else "resident"
    apply_layout(fig, title=_whose(records) + f"memory against time per step (median, 95% interval; {which} peak); filled: the frontier",
                 x_title="time per step (ms)", y_title=f"{which} peak above baseline (MB)", height=480)
    fig.update_xaxes(range=[0, right * 1e3 * 1.25])  # room for the names right of the points
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02))
    return _annotate(fig, _notes(records))


def _half(high: float, low: float) -> float:
    """One side of an error bar; 0 where there is no interval (one trial)."""
    return 0.0 if np.isnan(high) or np.isnan(low) else max(0.0, high - low)


def fit_figure(records: pd.DataFrame) -> go.Figure:
    """`benchlib fit`: where does each engine's total memory cross the limit? Per engine its measured or traced
    totals (dots), its size model (a line; dashed where no point was measured), what was measured to confirm an
    answer (open diamonds) and the confirmed answer (a star), against the scale parameter, in GB on a linear axis
    around the limit (a line), each largest fitting value marked."""
    totals = records[records["metric"] == "fit_total_bytes"]
    confirming = _param(totals, "confirms", False).astype(bool) if len(totals) else pd.Series(dtype=bool)
    measured, checked = totals[~confirming], totals[confirming]
    predicted = records[records["metric"] == "predicted_total_bytes"]
    either = measured if len(measured) else predicted
    params = json.loads(either["params"].iloc[0]) if len(either) else {}
    scale = params.get("scale", "value")
    traced_only = params.get("basis", "measured") != "measured"  # predicted without a GPU: no measured points
    fig = go.Figure()
    largest = records[records["metric"] == "max_fitting"]
    for engine in dict.fromkeys([*measured["variant"], *predicted["variant"]]):
        _engine_traces(fig, engine, (measured, predicted, checked, largest), scale, traced_only)
    for row in records[records["metric"] == "true_max_fitting"].itertuples():
        searched = json.loads(row.params)["searched"]
        at = int(row.value)
        if str(at) in searched:
            fig.add_trace(go.Scatter(x=[at], y=[searched[str(at)] / GB], mode="markers",
                                     name=f"{row.variant}: the answer, confirmed", legendgroup=row.variant,
                                     marker=dict(color=engine_color(row.variant), size=16, symbol="star"),
                                     hovertemplate=f"{row.variant}: %{{y:.3f}} GB measured at {scale}=%{{x}}, the "
                                                   "largest under the limit<extra>confirmed</extra>"))
    _limit_lines(fig, params)
    what = (f"CUDA reserved peak of one step against {scale}, {params['basis']}" if traced_only
            else f"total memory of one step against {scale}")
    if params.get("unseen"):  # CUDA's own kernel choices take memory the trace did not see
        what += "<br>a floor, not a bound: " + "; ".join(params["unseen"])
    marks = ("dotted: each engine's largest fitting value" if traced_only else
             "dotted: each engine's predicted answer; star: the answer measurement confirmed")
    apply_layout(fig, title=_whose(records) + f"{what}<br>({marks})",
                 x_title=scale, y_title="total memory (GB)", height=480)
    if traced_only:
        fig.update_xaxes(type="log")
    if params.get("limit"):  # the question is where each engine crosses the limit: the axis frames it
        fig.update_yaxes(range=[0, 1.5 * params["limit"] / GB])
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02))
    return fig


def _param(frame: pd.DataFrame, key: str, default=None) -> pd.Series:
    return frame["params"].map(lambda text: json.loads(text).get(key, default))


def _engine_traces(fig: go.Figure, engine: str, frames: tuple, scale: str, traced_only: bool) -> None:
    """One engine's measured totals, its size model's (or trace's) prediction, its answer's line and what was
    measured to confirm it (`frames`: measured, predicted, confirming and largest-value rows)."""
    measured, predicted, checked, largest = frames
    color = engine_color(engine)
    rows = measured[measured["variant"] == engine]
    if len(rows):
        fig.add_trace(go.Scatter(x=_param(rows, "value"), y=rows["value"] / GB, mode="markers",
                                 name=f"{engine} measured", legendgroup=engine, marker=dict(color=color, size=9),
                                 hovertemplate=f"{engine}: %{{y:.3f}} GB at {scale}=%{{x}}<extra>measured</extra>"))
    curve = predicted[predicted["variant"] == engine]
    if len(curve):
        curve = curve.assign(at=_param(curve, "value"), model=_param(curve, "model", "")).sort_values("at")
        for model, part in curve.groupby("model", sort=False):
            traced = traced_only and model == "trace"  # a prediction's traces: points, each a trace of its own
            fig.add_trace(go.Scatter(
                x=part["at"], y=part["value"] / GB, mode="markers" if traced else "lines",
                name=f"{engine} {'traced' if traced else model + ' model'}"
                     + ("" if len(rows) or traced_only else " (not measured)"), legendgroup=engine,
                line=dict(color=color, dash="solid" if traced_only else "dash"),
                marker=dict(color=color, size=7),
                hovertemplate=f"{engine}: %{{y:.3f}} GB at {scale}=%{{x}}<extra>predicted</extra>"))
    best = largest[largest["variant"] == engine]["value"]
    if len(curve) and len(best) and 0 < best.iloc[0] <= curve["at"].max():
        fig.add_vline(x=float(best.iloc[0]), line=dict(color=color, dash="dot", width=1))
    confirms = checked[checked["variant"] == engine]
    if len(confirms):
        fig.add_trace(go.Scatter(x=_param(confirms, "value"), y=confirms["value"] / GB, mode="markers",
                                 name=f"{engine} confirming", legendgroup=engine,
                                 marker=dict(color=color, size=11, symbol="diamond-open", line=dict(width=2)),
                                 hovertemplate=f"{engine}: %{{y:.3f}} GB at {scale}=%{{x}}"
                                               "<extra>measured to confirm</extra>"))


def _limit_lines(fig: go.Figure, params: dict) -> None:
    """The limit as a line, and what the answers stay under where a margin was kept."""
    limit = params.get("limit")
    if limit is None:
        return
    fig.add_hline(y=limit / GB, line=dict(color="#d62728", width=2),
                  annotation_text=f"limit {limit / GB:,.3f} GB", annotation_position="top left")
    if params.get("margin"):
        usable = limit * (1 - params["margin"])
        fig.add_hline(y=usable / GB, line=dict(color="#d62728", width=1, dash="dash"),
                      annotation_text=f"less the {100 * params['margin']:g}% margin: {usable / GB:,.3f} GB",
                      annotation_position="bottom left")
