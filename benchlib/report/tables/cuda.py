"""report.html's "CUDA caching allocator" part of a benchmark's section: reserved against allocated, the
reserve that holds no tensor, cudaMalloc calls and retries per case and engine, and links to the allocator
snapshots the run wrote (each opens in PyTorch's memory visualiser)."""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from benchlib.records.metrics import CUDA_ALLOC_RETRIES, CUDA_MALLOC_COUNT, CUDA_RESERVED_PEAK, CUDA_RESERVED_UNUSED
from benchlib.records.store import CUDA_SNAPSHOT_FOLDER
from benchlib.units import format_bytes

VIEW_METRICS = (CUDA_RESERVED_PEAK, CUDA_RESERVED_UNUSED, CUDA_MALLOC_COUNT, CUDA_ALLOC_RETRIES)
VISUALISER = "https://pytorch.org/memory_viz"


def allocator_table(records: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """Per case and engine, the median over its trials of each allocator metric, bytes written out."""
    rows = records[(records["benchmark"] == benchmark) & records["metric"].isin(VIEW_METRICS)]
    if rows.empty:
        return pd.DataFrame()
    medians = rows.pivot_table(index=["case", "variant"], columns="metric", values="value", aggfunc="median",
                               sort=False)
    table = pd.DataFrame({
        "case": medians.index.get_level_values(0), "engine": medians.index.get_level_values(1),
        "reserved at peak": [format_bytes(int(v)) for v in medians[CUDA_RESERVED_PEAK]],
        "reserved, no tensor": [format_bytes(int(v)) for v in medians[CUDA_RESERVED_UNUSED]],
        "share of reserve": [f"{u / r:.0%}" if r else "" for u, r in
                             zip(medians[CUDA_RESERVED_UNUSED], medians[CUDA_RESERVED_PEAK])],
        "cudaMalloc calls": medians[CUDA_MALLOC_COUNT].astype(int).to_numpy(),
        "retries": medians[CUDA_ALLOC_RETRIES].astype(int).to_numpy(),
    })
    return table


def snapshots(run_path: Path, benchmark: str) -> list[Path]:
    """The allocator snapshots of `benchmark` in this run (`benchmark-case-engine.pickle`)."""
    return sorted((run_path / CUDA_SNAPSHOT_FOLDER).glob(f"{benchmark}-*.pickle"))


def allocator_section(records: pd.DataFrame, benchmark: str, run_path: Path) -> str:
    """The HTML part, "" when the benchmark was not measured on CUDA."""
    table, files = allocator_table(records, benchmark), snapshots(run_path, benchmark)
    if table.empty and not files:
        return ""
    parts = ["<h3>CUDA caching allocator</h3><p>What the allocator held over the timed steps: its reserved peak "
             "(tensors plus its cache and block rounding: what an out-of-memory error is about), the part of it that "
             "held no tensor at the peak (fragmentation; reserved peak minus allocated peak), the segments it took "
             "from the driver (cudaMalloc calls, 0 once its cache holds a step) and the times it had to free its "
             "cache and retry. Medians over the trials.</p>"]
    if not table.empty:
        parts.append(table.to_html(index=False, border=0, classes="table", escape=True))
    if files:
        links = ", ".join(f"<a href='{html.escape(quote(f'{CUDA_SNAPSHOT_FOLDER}/{path.name}'))}'>"
                          f"{html.escape(path.stem.removeprefix(benchmark + '-'))}</a>" for path in files)
        parts.append(f"<p>Allocator snapshots of one more step (every segment and block, with the Python stack "
                     f"that allocated it): {links}. Drop one onto <a href='{VISUALISER}'>{VISUALISER}</a>, or run "
                     f"<code>python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html</code>.</p>")
    return "\n".join(parts)
