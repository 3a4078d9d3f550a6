"""Figures for notebooks/calibration.ipynb, built from its tidy records (benchlib.workloads.calibration)."""
from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go

from benchlib.report.plots.common import apply_layout, engine_color

_DASH = {"float32": "solid", "float64": "dash"}


def _rows(records: pd.DataFrame, case: str, metric: str) -> pd.DataFrame:
    rows = records[(records["case"] == case) & (records["metric"] == metric)].copy()
    if rows.empty:
        present = sorted(set(zip(records["case"], records["metric"])))
        raise ValueError(f"no {case!r} rows with metric {metric!r}; (case, metric) present: {present}")
    rows["params_dict"] = [json.loads(p) for p in rows["params"]]
    return rows


def _quartiles(rows: pd.DataFrame, by: list[str], scale: float) -> pd.DataFrame:
    """Median and quartiles of `value` per group, scaled (e.g. to GFLOP/s)."""
    grouped = rows.groupby(by, sort=True)["value"]
    out = pd.DataFrame({
        "median": grouped.median() * scale,
        "q25": grouped.quantile(0.25) * scale,
        "q75": grouped.quantile(0.75) * scale,
    }).reset_index()
    return out


def flop_rate_figure(records: pd.DataFrame) -> go.Figure:
    """GFLOP/s of the matrix product against n: one line per library and dtype, bars = quartiles."""
    rows = _rows(records, "matmul", "flop_rate")
    rows["n"] = [p["n"] for p in rows["params_dict"]]
    stats = _quartiles(rows, ["variant", "dtype", "n"], 1e-9)
    fig = go.Figure()
    for (engine, dtype), group in stats.groupby(["variant", "dtype"], sort=True):
        fig.add_trace(go.Scatter(
            x=group["n"], y=group["median"], mode="lines+markers", name=f"{engine} {dtype}",
            line=dict(color=engine_color(engine), dash=_DASH.get(dtype, "dot")),
            error_y=dict(type="data", symmetric=False, array=group["q75"] - group["median"],
                         arrayminus=group["median"] - group["q25"]),
            hovertemplate=f"{engine} {dtype} n=%{{x}}: %{{y:.3g}} GFLOP/s<extra></extra>"))
    device = ", ".join(sorted(rows["device"].unique()))
    sizes = sorted(stats["n"].unique())
    fig.update_xaxes(type="log", tickmode="array", tickvals=sizes, ticktext=[str(n) for n in sizes], minor=dict(showgrid=False))
    return apply_layout(fig, title=f"Matrix-product throughput on {device} (median of repeats; bars: quartiles)",
                        x_title="n (n×n @ n×n)", y_title="GFLOP/s")


def bandwidth_figure(records: pd.DataFrame) -> go.Figure:
    """Copy bandwidth (bytes read + written per second) per library, bars = median, whiskers = quartiles."""
    rows = _rows(records, "copy", "bandwidth")
    rows["MiB"] = [p["bytes"] / 2**20 for p in rows["params_dict"]]
    stats = _quartiles(rows, ["variant", "MiB"], 1e-9)
    fig = go.Figure()
    for engine, group in stats.groupby("variant", sort=True):
        fig.add_trace(go.Bar(
            x=[f"{m:g} MiB" for m in group["MiB"]], y=group["median"], name=engine,
            marker_color=engine_color(engine),
            error_y=dict(type="data", symmetric=False, array=group["q75"] - group["median"],
                         arrayminus=group["median"] - group["q25"]),
            text=[f"{v:.3g}" for v in group["median"]], textposition="outside",
            hovertemplate=f"{engine}: %{{y:.3g}} GB/s<extra></extra>"))
    device = ", ".join(sorted(rows["device"].unique()))
    return apply_layout(fig, title=f"Copy bandwidth on {device} (read + write)",
                        x_title="buffer size", y_title="GB/s").update_layout(barmode="group")


def overhead_frame(records: pd.DataFrame) -> pd.DataFrame:
    """One row per instrument setting: the ratio of medians and, where recorded, of minima."""
    rows = records[records["metric"].isin(["time_ratio", "time_ratio_min"])]
    if not (rows["metric"] == "time_ratio").any():
        raise ValueError("no 'time_ratio' rows: run the sampler and tracker overhead calibrations first")
    table = {}
    for _, row in rows.iterrows():
        params = json.loads(row["params"])
        if row["case"] == "sampler_overhead":
            setting = f"sampler every {params['interval_s'] * 1e3:g} ms"
        else:
            setting = f"{params['tracker']}: {params['workload']} ({row['device']})"
        entry = table.setdefault((row["case"], setting), {
            "instrument": row["case"], "setting": setting, "variant": row["variant"]})
        entry["ratio" if row["metric"] == "time_ratio" else "ratio_min"] = row["value"]
    return pd.DataFrame(list(table.values()))


def overhead_figure(records: pd.DataFrame) -> go.Figure:
    """Instrumented / plain time for the timeline sampler and the allocation trackers, as the
    ratio of medians and of minima side by side (1 = free; far apart = too noisy to tell)."""
    table = overhead_frame(records)
    fig = go.Figure()
    for column, label, color in (("ratio", "ratio of medians", "#1f77b4"),
                                 ("ratio_min", "ratio of minima", "#ff7f0e")):
        if column not in table:
            continue
        fig.add_trace(go.Bar(
            x=table["setting"], y=table[column], name=label, marker_color=color,
            text=[f"{r:.3f}x" for r in table[column]], textposition="outside",
            hovertemplate=f"%{{x}}: %{{y:.3f}}x ({label})<extra></extra>"))
    fig.add_hline(y=1.0, line_dash="dash", line_color="#4d4d4d")  # named on the axis: a label here sat on the bars
    return apply_layout(fig, title="Cost of the instrument (time with / without)",
                        x_title="instrument and workload",
                        y_title="time ratio (dashed: 1, no overhead)").update_layout(barmode="group")
