"""Figures for the mnist_ensembles notebook. Inputs are the tidy frames of
`benchlib.workloads.ensembles.steps_frame` / `summary_frame` and `lenet.lenet_frame`; every title
names the data source (``data=mnist`` or ``data=synthetic``)."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from benchlib.results.plots.common import apply_layout, engine_colors

GC_MARKER = dict(symbol="x", size=10, color="#d62728", line=dict(width=1))


def _data_label(frame: pd.DataFrame) -> str:
    return "data=" + "+".join(sorted(frame["data"].astype(str).unique()))


def step_time_trace(steps: pd.DataFrame, *, gc_policy: str = "default", heap_objects: int | None = None,
                    device: str = "") -> go.Figure:
    """Per-step time of each strategy (log scale) under one GC policy, steps with a GC pause
    marked with a red x (hover: pause count, seconds, generations): the thread's picture."""
    rows = steps[steps["gc_policy"] == gc_policy]
    if heap_objects is None:
        heap_objects = int(rows["heap_objects"].max())
    rows = rows[rows["heap_objects"] == heap_objects]
    if rows.empty:
        raise ValueError(f"no steps for gc_policy={gc_policy!r}, heap_objects={heap_objects}; "
                         f"present: {sorted(set(zip(steps['gc_policy'], steps['heap_objects'])))}")
    colors = engine_colors(rows["strategy"].unique())
    fig = go.Figure()
    for strategy, group in rows.groupby("strategy", sort=False):
        fig.add_trace(go.Scatter(x=group["step"], y=group["step_s"], mode="lines", name=strategy,
                                 line=dict(color=colors[strategy], width=1.5)))
        paused = group[group["gc_count"] > 0]
        if not paused.empty:
            fig.add_trace(go.Scatter(
                x=paused["step"], y=paused["step_s"], mode="markers", marker=GC_MARKER, showlegend=False,
                name=f"{strategy}: GC", customdata=paused[["gc_count", "gc_s", "gc_generations"]],
                hovertemplate=(f"{strategy} step %{{x}}: %{{y:.4g}} s<br>%{{customdata[0]}} collection(s), "
                               "%{customdata[1]:.3g} s, generation(s) %{customdata[2]}<extra></extra>")))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=GC_MARKER, name="step with a GC pause"))
    fig.update_yaxes(type="log")
    title = (f"Step time per strategy, gc={gc_policy}, heap={heap_objects} objects "
             f"({_data_label(rows)}{', ' + device if device else ''})")
    return apply_layout(fig, title=title, x_title="step", y_title="step time (s, log)")


def step_time_distribution(summary: pd.DataFrame, *, device: str = "") -> go.Figure:
    """Median, p99 and max step time per strategy x GC policy (one panel per heap size)."""
    stats = {"step_time_median": "median", "step_time_p99": "p99", "step_time_max": "max"}
    long = summary.melt(id_vars=["strategy", "gc_policy", "heap_objects", "data"], value_vars=list(stats),
                        var_name="statistic", value_name="seconds")
    long["statistic"] = long["statistic"].map(stats)
    long["heap"] = "heap=" + long["heap_objects"].astype(str)
    fig = px.scatter(long, x="strategy", y="seconds", color="gc_policy", symbol="statistic", facet_col="heap",
                     log_y=True, symbol_map={"median": "circle", "p99": "diamond", "max": "x"},
                     hover_data={"seconds": ":.4g"})
    fig.update_traces(marker=dict(size=10))
    title = f"Step time per strategy and GC policy: median, p99, max ({_data_label(summary)}{', ' + device if device else ''})"
    return apply_layout(fig, title=title, y_title="step time (s, log)", height=460)


def throughput_vs_floor(summary: pd.DataFrame, *, ceiling: float, ceiling_source: str,
                        gc_policy: str = "default", heap_objects: int = 0, device: str = "") -> go.Figure:
    """Throughput (model-samples/s) per strategy against the FLOP-floor ceiling: the matmul
    FLOP/s divided by the matmul FLOPs one model-sample needs."""
    rows = summary[(summary["gc_policy"] == gc_policy) & (summary["heap_objects"] == heap_objects)]
    if rows.empty:
        raise ValueError(f"no summary rows for gc_policy={gc_policy!r}, heap_objects={heap_objects}")
    rows = rows.sort_values("throughput")
    naive = rows.loc[rows["strategy"] == "naive", "throughput"]
    text = [f"{t:.3g}" + (f" ({t / naive.iloc[0]:.1f}x naive)" if len(naive) else "") for t in rows["throughput"]]
    fig = go.Figure(go.Bar(x=rows["strategy"], y=rows["throughput"], text=text, textposition="outside",
                           marker_color=[engine_colors(rows["strategy"])[s] for s in rows["strategy"]]))
    fig.add_hline(y=ceiling, line_dash="dash", annotation_text=f"FLOP floor: {ceiling:.3g} ({ceiling_source})")
    fig.update_yaxes(type="log")
    title = (f"Throughput vs the FLOP floor, gc={gc_policy}, heap={heap_objects} "
             f"({_data_label(rows)}{', ' + device if device else ''})")
    return apply_layout(fig, title=title, x_title="strategy", y_title="model-samples / s (log)")


def loss_curves(steps: pd.DataFrame, *, gc_policy: str = "default", heap_objects: int = 0, device: str = "") -> go.Figure:
    """Mean loss over the nets per step, one line per strategy: every strategy trains, and the
    per-net and batched strategies follow the same curve (same start, same batches)."""
    rows = steps[(steps["gc_policy"] == gc_policy) & (steps["heap_objects"] == heap_objects)]
    fig = px.line(rows, x="step", y="loss", color="strategy", color_discrete_map=engine_colors(rows["strategy"].unique()))
    title = f"Training loss (mean over nets), gc={gc_policy}, heap={heap_objects} ({_data_label(rows)}{', ' + device if device else ''})"
    return apply_layout(fig, title=title, x_title="step", y_title="cross-entropy")


def lenet_epochs(epochs: pd.DataFrame, *, data: str, device: str = "") -> go.Figure:
    """Epoch time per LeNet5 mode, GC share and estimated allocations on hover."""
    frame = epochs.assign(epoch=epochs["epoch"].astype(str))
    fig = px.bar(frame, x="mode", y="seconds", color="epoch", barmode="group",
                 hover_data={"gc_share": ":.2%", "alloc_bytes_est": ":.3s", "alloc_count_est": ":.3s", "loss": ":.4f"})
    title = f"5 LeNet5: epoch time per mode (data={data}{', ' + device if device else ''})"
    return apply_layout(fig, title=title, x_title="mode", y_title="seconds per epoch")


def collection_pauses(pauses: pd.DataFrame, *, data: str) -> go.Figure:
    """Full-collection pause against the long-lived heap, with and without ``gc.freeze()``."""
    frame = pauses.assign(state=pauses["frozen"].map({True: "after gc.freeze()", False: "not frozen"}))
    hover = {"tracked_objects": ":,"} if "tracked_objects" in frame else None
    fig = px.line(frame, x="heap_objects", y="pause_s", color="state", markers=True, log_y=True, hover_data=hover)
    title = f"gc.collect() pause vs long-lived heap, frozen or not (data={data})"
    return apply_layout(fig, title=title, x_title="samples held as (tensor, label) tuples", y_title="pause (s, log)")
