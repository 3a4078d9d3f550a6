"""The instrument's own cost in report.html and after `benchlib run`: where the isolated trials' time went,
phase by phase (`analysis.harness.phase_table`), so what measuring cost is read beside what it measured."""

from __future__ import annotations

import pandas as pd

from benchlib.analysis.harness import phase_table
from benchlib.units import format_seconds


def harness_line(records: pd.DataFrame) -> str:
    """One line: the trials' whole time and each phase's share, largest first; "" when no trial was isolated."""
    table = phase_table(records)
    if table.empty:
        return ""
    shares = ", ".join(f"{row.phase.replace('_', ' ')} {row.share:.0%}" for row in table.sort_values("share", ascending=False).itertuples()
                       if row.share >= 0.005)
    trials = int(table.loc[table["phase"] == "timed", "trials"].sum())
    return (f"instrument: {trials} isolated trial(s) took {format_seconds(float(table['seconds'].sum()))}: {shares} "
            "(timed: the calls the figures are made of)")


def harness_section(records: pd.DataFrame) -> str:
    """report.html's part: per benchmark, the seconds of each phase summed over its trials, their share and
    the median per trial; "" when no trial was isolated."""
    table = phase_table(records, by=("benchmark",))
    if table.empty:
        return ""
    shown = pd.DataFrame({
        "benchmark": table["benchmark"], "phase": table["phase"].str.replace("_", " "),
        "seconds": [format_seconds(float(s)) for s in table["seconds"]], "share": [f"{s:.0%}" for s in table["share"]],
        "trials": table["trials"].astype(int), "median per trial": [format_seconds(float(s)) for s in table["median_s"]],
    })
    return ("<h2 id='harness'>Where the trials' time went</h2><p>Each isolated trial times its phases: starting "
            "its process (fork or a fresh interpreter, and its exit), set-up (importing and building what it measures), "
            "warm-up, the timed calls the figures come from, the allocation and attribution passes, the check, the "
            "role pass and the CUDA snapshot. The rest of a notebook's time is its kernel, tables and figures.</p>"
            + shown.to_html(index=False, border=0, classes="table", escape=True))
