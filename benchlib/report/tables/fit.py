"""`benchlib fit`'s answer in report.html: its two answers in words, then one row per engine (the largest value,
the total there with its interval or how it was measured, time per sample, the size model, why an engine has no
answer). A table whose cells wrap, so nothing is clipped at the page's edge."""

from __future__ import annotations

import math

import pandas as pd

from benchlib.engine_names import COMBINED
from benchlib.units import format_bytes, format_seconds

FIT_COLUMNS = frozenset({"engine", "largest", "total_bytes", "basis", "seconds_per_sample", "answer"})


def is_fit_headline(headline: pd.DataFrame) -> bool:
    return FIT_COLUMNS <= set(headline.columns)


def fit_answers(headline: pd.DataFrame) -> list[str]:
    """The answers' sentences, in the order the rows give them."""
    return [line for text in headline["answer"] if isinstance(text, str) for line in text.splitlines() if line]


def fit_table(headline: pd.DataFrame) -> pd.DataFrame:
    """One row per engine, in words and units."""
    scale = next((value for value in headline.get("scale", ()) if isinstance(value, str)), "value")
    rows = []
    for row in headline.to_dict("records"):
        largest = row["largest"]
        answered = largest is not None and not (isinstance(largest, float) and math.isnan(largest))
        rows.append({
            "engine": str(row["engine"]).replace("-", "\u2011").replace(COMBINED, f"{COMBINED}\u200b"),
            f"largest {scale}": f"{int(largest):,}" if answered else "",
            "total there": _total(row),
            "time per sample": _time(row),
            "how it was reached": row["basis"] or "",
            "size model": row.get("model") or "",
            "why not, notes": row.get("reason") or "",
        })
    return pd.DataFrame(rows)


def _total(row: dict) -> str:
    total = row["total_bytes"]
    if total is None or math.isnan(total):
        return ""
    low, high = row.get("total_low"), row.get("total_high")
    if low is None or high is None or math.isnan(low) or format_bytes(int(low)) == format_bytes(int(high)):
        return format_bytes(int(total))
    return f"{format_bytes(int(total))} [{format_bytes(int(low))}, {format_bytes(int(high))}]"


def _time(row: dict) -> str:
    seconds = row["seconds_per_sample"]
    if seconds is None or math.isnan(seconds):
        return ""
    return f"{format_seconds(seconds)} ({row.get('time_basis') or 'measured'})"
