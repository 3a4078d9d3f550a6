"""Figures for the mnist_ensembles notebook. Inputs are the tidy frames of
`benchlib.workloads.ensembles.steps_frame` / `summary_frame` and `lenet.lenet_frame`; every title
names the data source (``data=mnist`` or ``data=synthetic``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from benchlib.report.plots.common import apply_layout, engine_colors, legend_right, log_axis

def _data_label(frame: pd.DataFrame) -> str:
    return "data=" + "+".join(sorted(frame["data"].astype(str).unique()))


def _first_trial(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps of each cell's first trial: a per-step trace shows one run, not trials overlaid."""
    return steps[steps["trial"] == 0] if "trial" in steps else steps


def step_time_trace(steps: pd.DataFrame, *, gc_policy: str = "default", heap_objects: int | None = None,
                    device: str = "") -> go.Figure:
    """Per-step time of each strategy (log scale) under one GC policy: the thread's picture.

    Per-net strategies run fewer, slower steps than the batched ones, so strategies are grouped
    into panels by their number of steps, each panel on its own step axis. A step that held a GC
    pause is marked with an x in its strategy's colour (hover: pause count, seconds, generations).
    The first trial of each cell is shown.
    """
    steps = _first_trial(steps)
    rows = steps[steps["gc_policy"] == gc_policy]
    if heap_objects is None:
        heap_objects = int(rows["heap_objects"].max())
    rows = rows[rows["heap_objects"] == heap_objects]
    if rows.empty:
        raise ValueError(f"no steps for gc_policy={gc_policy!r}, heap_objects={heap_objects}; "
                         f"present: {sorted(set(zip(steps['gc_policy'], steps['heap_objects'])))}")
    strategies = list(dict.fromkeys(rows["strategy"]))
    step_counts = rows.groupby("strategy", sort=False)["step"].nunique()
    panels = [[s for s in strategies if step_counts[s] == count] for count in sorted(set(step_counts))]
    titles = [f"{step_counts[panel[0]]} steps: {', '.join(panel)}" for panel in panels]
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.05)
    colors = engine_colors(strategies)
    for column, panel in enumerate(panels, start=1):
        for strategy in panel:
            group = rows[rows["strategy"] == strategy]
            fig.add_trace(go.Scatter(x=group["step"], y=group["step_s"], mode="lines", name=strategy, legendgroup=strategy,
                                     line=dict(color=colors[strategy], width=1.5)), row=1, col=column)
            paused = group[group["gc_count"] > 0]
            if not paused.empty:
                fig.add_trace(go.Scatter(
                    x=paused["step"], y=paused["step_s"], mode="markers", legendgroup=strategy, showlegend=False,
                    marker=dict(symbol="x", size=10, color=colors[strategy], line=dict(width=1, color="#000000")),
                    name=f"{strategy}: GC", customdata=paused[["gc_count", "gc_s", "gc_generations"]],
                    hovertemplate=(f"{strategy} step %{{x}}: %{{y:.4g}} s<br>%{{customdata[0]}} collection(s), "
                                   "%{customdata[1]:.3g} s, generation(s) %{customdata[2]}<extra></extra>")),
                    row=1, col=column)
        fig.update_xaxes(title_text="step", row=1, col=column)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="× = step with a GC pause",
                             marker=dict(symbol="x", size=10, color="#ffffff", line=dict(width=1, color="#000000"))))
    log_axis(fig, rows["step_s"])
    title = (f"Step time per strategy, gc={gc_policy}, heap={heap_objects} objects "
             f"({_data_label(rows)}{', ' + device if device else ''})")
    apply_layout(fig, title=title).update_yaxes(title_text="step time (s, log)", row=1, col=1)
    return legend_right(fig)


def step_time_distribution(summary: pd.DataFrame, *, device: str = "") -> go.Figure:
    """Median, p99 and max step time per strategy x GC policy (one panel per long-lived heap size)."""
    stats = {"step_time_median": "median", "step_time_p99": "p99", "step_time_max": "max"}
    long = summary.melt(id_vars=["strategy", "gc_policy", "heap_objects", "data"], value_vars=list(stats),
                        var_name="statistic", value_name="seconds")
    long["statistic"] = long["statistic"].map(stats)
    fig = px.scatter(long, x="strategy", y="seconds", color="gc_policy", symbol="statistic", facet_col="heap_objects",
                     symbol_map={"median": "circle", "p99": "diamond", "max": "x"},
                     labels={"heap_objects": "long-lived heap objects", "gc_policy": "GC policy"},
                     hover_data={"seconds": ":.4g"})
    fig.update_traces(marker=dict(size=10))
    title = f"Step time per strategy and GC policy: median, p99, max ({_data_label(summary)}{', ' + device if device else ''})"
    log_axis(fig, long["seconds"])
    apply_layout(fig, title=title, height=480)
    fig.update_yaxes(title_text="")  # one axis title, on the first panel: another would sit on its neighbour's ticks
    fig.update_yaxes(title_text="step time (s, log)", col=1)
    return legend_right(fig)


def throughput_vs_floor(per_trial: pd.DataFrame, *, ceiling: float, ceiling_source: str,
                        gc_policy: str = "default", heap_objects: int = 0, device: str = "") -> go.Figure:
    """Throughput (model-samples/s) per strategy against the FLOP-floor ceiling: the matmul
    FLOP/s divided by the matmul FLOPs one model-sample needs. A linear axis, so a 20x gap looks like one.

    `per_trial` is `summary_frame` (one row per cell and trial): bars are medians over trials, error
    bars their min and max, labels the gain over naive with its 95% interval."""
    from benchlib.analysis.stats import ratio_of_medians

    cells = per_trial[(per_trial["gc_policy"] == gc_policy) & (per_trial["heap_objects"] == heap_objects)]
    if cells.empty:
        raise ValueError(f"no summary rows for gc_policy={gc_policy!r}, heap_objects={heap_objects}")
    rows = (cells.groupby("strategy", sort=False)["throughput"].agg(["median", "min", "max", "size"])
            .sort_values("median").reset_index())
    naive = cells.loc[cells["strategy"] == "naive", "throughput"].to_numpy(float)

    def label(strategy: str, median: float) -> str:
        if naive.size == 0 or strategy == "naive":
            return f"{median:.3g}"
        own = cells.loc[cells["strategy"] == strategy, "throughput"].to_numpy(float)
        gain = ratio_of_medians(naive, own)
        interval = f" [{gain.ci_low:.1f}, {gain.ci_high:.1f}]" if min(naive.size, own.size) >= 2 else ""
        return f"{median:.3g} ({gain.ratio:.1f}x naive{interval})"

    text = [label(s, m) for s, m in zip(rows["strategy"], rows["median"])]
    fig = go.Figure(go.Bar(
        x=rows["strategy"], y=rows["median"], text=text, textposition="outside",
        name=f"median of {int(rows['size'].max())} trial(s); bars: min to max",
        error_y=dict(type="data", symmetric=False, array=rows["max"] - rows["median"],
                     arrayminus=rows["median"] - rows["min"], color="#444444"),
        marker_color=[engine_colors(rows["strategy"])[s] for s in rows["strategy"]]))
    fig.add_hline(y=ceiling, line_dash="dash", line_color="#222222",
                  annotation_text=f"FLOP floor: {ceiling:.3g} model-samples/s ({ceiling_source})",
                  annotation_position="top left")
    fig.update_yaxes(range=[0, max(ceiling, float(rows["max"].max())) * 1.12])
    title = (f"Throughput vs the FLOP floor, gc={gc_policy}, heap={heap_objects} "
             f"({_data_label(cells)}{', ' + device if device else ''})")
    return apply_layout(fig, title=title, x_title="strategy", y_title="model-samples / s")


def loss_curves(steps: pd.DataFrame, *, gc_policy: str = "default", heap_objects: int = 0, device: str = "") -> go.Figure:
    """Mean loss over the nets per step, one line per strategy: every strategy trains, and the
    per-net and batched strategies follow the same curve (same start, same batches); first trial."""
    steps = _first_trial(steps)
    rows = steps[(steps["gc_policy"] == gc_policy) & (steps["heap_objects"] == heap_objects)]
    # Strategies that train alike overlap exactly: a dash per strategy keeps each line visible.
    fig = px.line(rows, x="step", y="loss", color="strategy", line_dash="strategy",
                  color_discrete_map=engine_colors(rows["strategy"].unique()))
    title = f"Training loss (mean over nets), gc={gc_policy}, heap={heap_objects} ({_data_label(rows)}{', ' + device if device else ''})"
    return apply_layout(fig, title=title, x_title="step", y_title="cross-entropy")


def lenet_epochs(epochs: pd.DataFrame, *, data: str, device: str = "") -> go.Figure:
    """Epoch time per LeNet5 mode, GC share and estimated allocations on hover."""
    frame = epochs.assign(epoch="epoch " + epochs["epoch"].astype(str))
    fig = px.bar(frame, x="epoch", y="seconds", color="mode", barmode="group",
                 color_discrete_map=engine_colors(frame["mode"].unique()),
                 hover_data={"gc_share": ":.2%", "alloc_bytes_est": ":.3s", "alloc_count_est": ":.3s", "loss": ":.4f"})
    title = f"5 LeNet5: epoch time per mode (data={data}{', ' + device if device else ''})"
    steps, batch, full = (int(epochs[c].iloc[0]) for c in ("steps", "batch", "steps_per_full_pass"))
    cut = f" (of a full pass's {full}, cut by lenet_step_limit)" if steps < full else " (one full pass)"
    return apply_layout(fig, title=title, x_title=f"epoch: {steps} steps of {batch} samples{cut}",
                        y_title="seconds per epoch")


GC_POLICY_COLORS = {"default": "#1f77b4", "freeze": "#2ca02c", "thresholds": "#ff7f0e", "manual": "#d62728"}
GC_POLICY_DASHES = {"default": "solid", "freeze": "dash", "thresholds": "dot", "manual": "dashdot"}  # lines that coincide stay visible
GENERATION_COLORS = {0: "#9ecae1", 1: "#3182bd", 2: "#08306b"}


def cycle_traces(steps: pd.DataFrame, *, strategy: str, device: str = "") -> go.Figure:
    """The GC experiment for one strategy at its most cycles per step, first trial: step time (log,
    a cross where a collection began) and the MB the uncollected cycles hold after each step, one
    line per GC policy. What each collector's schedule does to time and to memory, on one step axis."""
    steps = _first_trial(steps)
    rows = steps[steps["strategy"] == strategy]
    if rows.empty:
        raise ValueError(f"no GC-experiment steps for strategy {strategy!r}; present: {sorted(steps['strategy'].unique())}")
    cycles = int(rows["cycles"].max())
    rows = rows[rows["cycles"] == cycles]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.55, 0.45])
    for policy, group in rows.groupby("gc_policy", sort=False):
        color = GC_POLICY_COLORS.get(policy, "#7f7f7f")
        line = dict(color=color, width=2, dash=GC_POLICY_DASHES.get(policy, "solid"))
        fig.add_trace(go.Scatter(x=group["step"], y=group["step_s"], mode="lines", name=policy, legendgroup=policy,
                                 line=line), row=1, col=1)
        paused = group[group["gc_count"] > 0]
        fig.add_trace(go.Scatter(
            x=paused["step"], y=paused["step_s"], mode="markers", legendgroup=policy, showlegend=False,
            marker=dict(symbol="x", size=9, color=color), customdata=paused[["gc_count", "gc_s", "gc_generations"]],
            hovertemplate=(f"{policy} step %{{x}}: %{{y:.4g}} s<br>%{{customdata[0]}} collection(s), %{{customdata[1]:.3g}} s, "
                           "generation(s) %{customdata[2]}<extra></extra>")), row=1, col=1)
        fig.add_trace(go.Scatter(x=group["step"], y=group["cycle_bytes"] / 1e6, mode="lines", legendgroup=policy,
                                 showlegend=False, line=line,
                                 hovertemplate=f"{policy} step %{{x}}: %{{y:.1f}} MB held<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="× = a collection began",
                             marker=dict(symbol="x", size=9, color="#444444")))
    log_axis(fig, rows["step_s"], row=1, col=1)
    fig.update_yaxes(title_text="step time (s, log)", row=1, col=1)
    fig.update_yaxes(title_text="held by cycles (MB)", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    heap = int(rows["heap_objects"].iloc[0])
    title = (f"{strategy}, {cycles} reference cycles per step, heap={heap}: step time and memory per GC policy "
             f"({_data_label(rows)}{', ' + device if device else ''})")
    apply_layout(fig, title=title, height=560)
    return legend_right(fig)


def pauses_vs_tracked(training_pauses: pd.DataFrame, experiment_pauses: pd.DataFrame, *, fit=None,
                      device: str = "") -> go.Figure:
    """Every collection's pause against the tracked objects it walked. Left, both axes log: the
    training steps' collections by generation (circles) and the `gc.collect()` experiment's full
    collections over each heap, frozen or not (diamonds). Right, linear: the full collections alone,
    with `fit` (`full_collection_fit`, through the experiment's) as a line: what each extra object
    costs. Long pauses follow the objects walked, not the heap parameter. Collections whose objects
    were not counted (`tracked_before` -1: the main grid's) are left out."""
    if training_pauses is None:  # the GC experiment was not run (the --budget): the heap experiment alone
        training_pauses = pd.DataFrame()
    training_pauses = training_pauses[training_pauses["tracked_before"] >= 0] if len(training_pauses) else training_pauses
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.1,
                        subplot_titles=("every collection (log-log)", "full collections (linear) and the fit" if fit is not None
                                        else "full collections (linear); too few object counts for a fit"))
    experiment = experiment_pauses.assign(state=experiment_pauses["frozen"].map(
        {True: "gc.collect() after gc.freeze()", False: "gc.collect() over the heap"}))
    for column in (1, 2):
        for state, group in experiment.groupby("state", sort=False):
            if column == 2 and state.endswith("freeze()"):
                continue  # a handful of objects: off the right panel's scale
            fig.add_trace(go.Scatter(
                x=group["tracked_before"], y=group["pause_s"] * (1 if column == 1 else 1e3), mode="markers", name=state,
                legendgroup=state, showlegend=column == 1,
                marker=dict(size=10, symbol="diamond-open" if state.endswith("freeze()") else "diamond", color="#e6550d",
                            line=dict(width=1.5)),
                customdata=group[["heap_objects"]],
                hovertemplate="%{x:,} objects: %{y:.3g}<br>heap=%{customdata[0]:,}<extra></extra>"), row=1, col=column)
        for generation, group in training_pauses.groupby("generation") if len(training_pauses) else ():
            if column == 2 and generation != 2:
                continue
            name = f"training step, generation {generation}"
            fig.add_trace(go.Scatter(
                x=group["tracked_before"], y=group["pause_s"] * (1 if column == 1 else 1e3), mode="markers", name=name,
                legendgroup=name, showlegend=column == 1,
                marker=dict(size=7, color=GENERATION_COLORS.get(generation, "#7f7f7f"), opacity=0.8,
                            line=dict(width=0.5, color="#ffffff")),
                customdata=group[["strategy", "gc_policy", "heap_objects", "cycles", "collected"]],
                hovertemplate=("%{x:,} objects: %{y:.3g}<br>%{customdata[0]}, gc=%{customdata[1]}, heap=%{customdata[2]}, "
                               "cycles=%{customdata[3]}<br>%{customdata[4]} collected<extra></extra>")), row=1, col=column)
    if fit is not None:
        xs = pd.Series(np.linspace(fit.x_low, fit.x_high, 30))
        fig.add_trace(go.Scatter(
            x=xs, y=1e3 * (fit.intercept + fit.slope * xs), mode="lines", line=dict(color="#222222", dash="dash"),
            name=(f"fit through gc.collect() over the heaps: {fit.slope * 1e8:.2f} ms per 100k objects "
                  f"[{fit.ci_low * 1e8:.2f}, {fit.ci_high * 1e8:.2f}]")), row=1, col=2)
    every = pd.concat([training_pauses, experiment_pauses], ignore_index=True)
    fig.update_xaxes(type="log", tickformat="~s", title_text="tracked objects walked (log)", row=1, col=1)
    fig.update_xaxes(tickformat="~s", title_text="tracked objects walked", row=1, col=2)
    log_axis(fig, every["pause_s"], row=1, col=1)
    fig.update_yaxes(title_text="pause (s, log)", row=1, col=1)
    fig.update_yaxes(title_text="pause (ms)", row=1, col=2)
    title = f"GC pause against the objects the collection walked ({_data_label(every)}{', ' + device if device else ''})"
    apply_layout(fig, title=title, height=560)
    return fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
                             margin=dict(b=150))
