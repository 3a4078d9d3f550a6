"""mnist_ensembles tables and closing summary, from `summary_frame`-shaped frames (one row per cell)."""

from __future__ import annotations

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


def batched_gain(per_trial: pd.DataFrame) -> pd.DataFrame:
    """Throughput of each batched strategy over naive's, per data x GC policy x heap cell: the ratio
    of medians over trials with its 95% bootstrap interval (`summary_frame`, one row per trial)."""
    from benchlib.results.stats import ratio_of_medians

    rows = []
    for (data, policy, heap), cell in per_trial.groupby(["data", "gc_policy", "heap_objects"], sort=False):
        naive = cell.loc[cell["strategy"] == "naive", "throughput"].to_numpy(float)
        for strategy in ("batched_vmap", "batched_hand"):
            own = cell.loc[cell["strategy"] == strategy, "throughput"].to_numpy(float)
            if naive.size == 0 or own.size == 0:
                continue
            gain = ratio_of_medians(naive, own)
            single = min(naive.size, own.size) < 2
            rows.append({"data": data, "gc_policy": policy, "heap_objects": heap, "strategy": strategy,
                         "trials": min(naive.size, own.size), "gain_over_naive": gain.ratio,
                         "ci_low": float("nan") if single else gain.ci_low,
                         "ci_high": float("nan") if single else gain.ci_high})
    return pd.DataFrame(rows, columns=["data", "gc_policy", "heap_objects", "strategy", "trials", "gain_over_naive",
                                       "ci_low", "ci_high"]).round(2)


def closing_text(summary: pd.DataFrame, threads: pd.DataFrame, *, floor_step_s: float, device: str) -> str:
    """The closing note's lines: the FLOP floor, the best cell's spread, each thread count's spread."""
    cells = with_display_units(summary)
    best = cells.loc[cells["throughput"].idxmax()]
    first = cells.iloc[0]
    lines = [f"data={first['data']}, device={device}; FLOP floor {floor_step_s * 1e3:.2f} ms per step",
             f"best cell: {best['strategy']} gc={best['gc_policy']} heap={best['heap_objects']}: median "
             f"{best['median_ms']:.2f} ms, p99 {best['p99_ms']:.2f} ms (p99/median {best['p99_over_median']:.2f})"]
    for row in with_display_units(threads).itertuples():
        lines.append(f"{row.strategy} gc={row.gc_policy} at {row.torch_threads} torch thread(s): median "
                     f"{row.median_ms:.2f} ms, p99/median {row.p99_over_median:.2f}")
    return "\n".join(lines)
