"""mnist_ensembles tables and closing summary, from `summary_frame`-shaped frames (one row per cell)."""

from __future__ import annotations

import numpy as np
import pandas as pd

CELL_COLUMNS = ["data", "heap_objects", "gc_policy", "strategy", "trials", "median_ms", "p99_ms", "max_ms", "p99_over_median",
                "throughput", "gc_pct", "gc_pauses", "alloc_count_per_step", "alloc_count_python_per_step", "alloc_MB_per_step", "peak_MB",
                "final_loss"]


def with_display_units(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary in ms, %, MB, with p99 / median (the spread the thread's target is about)."""
    return summary.assign(
        median_ms=summary["step_time_median"] * 1e3, p99_ms=summary["step_time_p99"] * 1e3,
        max_ms=summary["step_time_max"] * 1e3, p99_over_median=summary["step_time_p99"] / summary["step_time_median"],
        gc_pct=100 * summary["gc_share"], alloc_MB_per_step=summary["alloc_bytes_per_step"] / 1e6,
        peak_MB=summary["peak_bytes"] / 1e6)


def cell_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy x GC policy x heap cell, rounded for reading."""
    return with_display_units(summary)[CELL_COLUMNS].round(3)


def threads_table(threads: pd.DataFrame) -> pd.DataFrame:
    """The thread sweep: median, p99 and their ratio per torch thread count."""
    return with_display_units(threads)[["data", "strategy", "gc_policy", "torch_threads", "median_ms", "p99_ms",
                                        "p99_over_median", "throughput"]].round(3)


BATCHED = ("batched_vmap", "batched_hand", "batched_fused")


def batched_gain(per_trial: pd.DataFrame, *, ceiling: float | None = None) -> pd.DataFrame:
    """Each batched strategy against naive and the FLOP floor, per data x GC policy x heap cell, from
    `summary_frame` (one row per trial): its median throughput (model-samples/s); that over naive's
    (ratio of medians over trials, 95% bootstrap interval); with ``ceiling`` (the floor's
    model-samples/s), how many times below it the strategy runs (`below_floor`: ceiling over its
    median throughput, interval over trials); its p99/median step time (median over trials). The
    closing note's three targets read off one row."""
    from benchlib.analysis.stats import median_interval, ratio_of_medians

    nan = float("nan")
    rows = []
    for (data, policy, heap), cell in per_trial.groupby(["data", "gc_policy", "heap_objects"], sort=False):
        naive = cell.loc[cell["strategy"] == "naive", "throughput"].to_numpy(float)
        for strategy in BATCHED:
            own_rows = cell[cell["strategy"] == strategy]
            own = own_rows["throughput"].to_numpy(float)
            if naive.size == 0 or own.size == 0:
                continue
            gain = ratio_of_medians(naive, own)
            single = min(naive.size, own.size) < 2
            row = {"data": data, "gc_policy": policy, "heap_objects": heap, "strategy": strategy,
                   "trials": min(naive.size, own.size), "throughput": float(np.median(own)),
                   "gain_over_naive": gain.ratio, "ci_low": nan if single else gain.ci_low,
                   "ci_high": nan if single else gain.ci_high,
                   "p99_over_median": float((own_rows["step_time_p99"] / own_rows["step_time_median"]).median())}
            if ceiling is not None:
                below = median_interval(ceiling / own)
                row |= {"below_floor": below.ratio, "below_floor_low": below.ci_low if own.size > 1 else nan,
                        "below_floor_high": below.ci_high if own.size > 1 else nan}
            rows.append(row)
    floor_columns = ("below_floor", "below_floor_low", "below_floor_high") if ceiling is not None else ()
    columns = ["data", "gc_policy", "heap_objects", "strategy", "trials", "throughput", "gain_over_naive", "ci_low",
               "ci_high", *floor_columns, "p99_over_median"]
    return pd.DataFrame(rows, columns=columns).round(2)


def closing_text(summary: pd.DataFrame, threads: pd.DataFrame | None, *, floor_step_s: float, device: str) -> str:
    """The closing note's lines: the FLOP floor, the best cell's spread, each thread count's spread (none
    when the thread sweep was not run)."""
    cells = with_display_units(summary)
    best = cells.loc[cells["throughput"].idxmax()]
    first = cells.iloc[0]
    lines = [f"data={first['data']}, device={device}; FLOP floor {floor_step_s * 1e3:.2f} ms per step",
             f"best cell: {best['strategy']} gc={best['gc_policy']} heap={best['heap_objects']}: median "
             f"{best['median_ms']:.2f} ms, p99 {best['p99_ms']:.2f} ms (p99/median {best['p99_over_median']:.2f})"]
    for row in (with_display_units(threads).itertuples() if threads is not None else ()):
        lines.append(f"{row.strategy} gc={row.gc_policy} at {row.torch_threads} torch thread(s): median "
                     f"{row.median_ms:.2f} ms, p99/median {row.p99_over_median:.2f}")
    return "\n".join(lines)


def cycles_table(per_trial: pd.DataFrame, pauses: pd.DataFrame) -> pd.DataFrame:
    """The GC experiment, one row per strategy x GC policy x cycles per step: step-time median, p99
    and max, GC share, memory, collections per generation (medians over trials), the longest pause
    of any trial (all after warm-up), and the p99's ratio to the same policy without cycles with its
    95% interval over trials. `per_trial` is `summary_frame` of the experiment, `pauses` its
    `pauses_frame`."""
    from benchlib.analysis.stats import ratio_of_medians

    held = per_trial["cycle_bytes_max"] if "cycle_bytes_max" in per_trial else pd.Series(float("nan"), per_trial.index)
    cells = with_display_units(per_trial).assign(held_MB=held.where(per_trial["cycles"] > 0, 0.0) / 1e6,
                                                 memory_MB=per_trial["step_memory_max"] / 1e6)
    keys = ["strategy", "gc_policy", "cycles"]
    counted = ["gen0", "gen1", "gen2"]
    if len(pauses):
        pauses = pauses[pauses["step"] >= pauses["warmup"]]  # as the step statistics, after warm-up
    if len(pauses):
        per_generation = (pauses.groupby([*keys, "trial", "generation"]).size().unstack(fill_value=0)
                          .reindex(columns=[0, 1, 2], fill_value=0).set_axis(counted, axis=1).reset_index())
        cells = cells.merge(per_generation, on=[*keys, "trial"], how="left")
    cells[counted] = cells.reindex(columns=counted).fillna(0)
    by_cell = cells.groupby(["data", "heap_objects", *keys], sort=False)
    table = by_cell[["median_ms", "p99_ms", "max_ms", "gc_pct", "held_MB", "memory_MB", *counted]].median()
    table.insert(0, "trials", by_cell.size())
    table = table.reset_index()
    longest = pauses.groupby(keys)["pause_s"].max() if len(pauses) else pd.Series(dtype=float)
    table["longest_pause_ms"] = [1e3 * longest.get(tuple(cell), 0.0) for cell in table[keys].itertuples(index=False)]
    ratios = []
    for row in table.itertuples():
        own = cells[(cells["strategy"] == row.strategy) & (cells["gc_policy"] == row.gc_policy)]
        base, with_cycles = (own.loc[own["cycles"] == n, "p99_ms"].to_numpy(float) for n in (0, row.cycles))
        ratio = ratio_of_medians(base, with_cycles) if base.size and row.cycles else None
        enough = ratio is not None and min(base.size, with_cycles.size) >= 2
        ratios.append({"p99_vs_no_cycles": ratio.ratio if ratio else float("nan"),
                       "ci_low": ratio.ci_low if enough else float("nan"),
                       "ci_high": ratio.ci_high if enough else float("nan")})
    return pd.concat([table, pd.DataFrame(ratios)], axis=1).round(3)


FIT_SPREAD = 1.5  # the object counts a pause fit needs: the largest at least this many times the smallest


def full_collection_fit(experiment_pauses: pd.DataFrame):
    """The pause of a full collection against the tracked objects it walked: a robust (Theil-Sen)
    line through the `gc.collect()` experiment's pauses over each long-lived heap, not frozen
    (`benchlib.analysis.stats.LinearFit`, slope in seconds per object), or None with fewer than three
    such pauses at two object counts, or with object counts too close to carry a slope (the largest less
    than `FIT_SPREAD` times the smallest: at quick sizes the heaps differ by under 1%, and a line through
    them read -169 ms per 100k objects [-976, 175255]). Those collections find no garbage, so the line is the cost of
    walking; the training steps' full collections also free what they find, and frozen ones walk a
    handful of objects. The interval reflects the scatter of one sitting's pauses, not drift
    between sittings."""
    from benchlib.analysis.stats import linear_fit

    walked = experiment_pauses[(experiment_pauses["generation"] == 2) & ~experiment_pauses["frozen"].astype(bool)] \
        if len(experiment_pauses) else experiment_pauses
    if len(walked) < 3 or walked["tracked_before"].nunique() < 2 \
            or walked["tracked_before"].max() < FIT_SPREAD * walked["tracked_before"].min():
        return None
    return linear_fit(walked["tracked_before"], walked["pause_s"], robust=True)


def pause_slope_text(fit) -> str:
    """One line: what 100,000 more tracked objects add to a full collection, with the interval."""
    if fit is None:
        return ("full-collection pause against tracked objects: too few full collections, or their object counts "
                f"too close (less than {FIT_SPREAD}x apart: raise heap_objects), to fit a line")
    per = 1e5 * 1e3  # ms per 100,000 objects
    return (f"full collection (gc.collect() over the heaps): {fit.slope * per:.2f} ms per 100,000 tracked objects "
            f"[{fit.ci_low * per:.2f}, {fit.ci_high * per:.2f}] ({fit.confidence:.0%}, {fit.method}, {fit.n} pauses "
            f"from {fit.x_low:,.0f} to {fit.x_high:,.0f} objects)")
