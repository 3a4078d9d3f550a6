"""`benchlib fit`'s answer in report.html: its two answers in words, then one row per engine (the largest value,
the total there with its interval or how it was measured, time per sample, the size model, why an engine has no
answer). A table whose cells wrap, so nothing is clipped at the page's edge."""

from __future__ import annotations

import math

import pandas as pd

from benchlib.engine_names import COMBINED
from benchlib.units import format_bytes, format_seconds

NO_BREAK = "\u00a0"
FIT_COLUMNS = frozenset({"engine", "largest", "total_bytes", "basis", "seconds_per_sample", "answer"})


def is_fit_headline(headline: pd.DataFrame) -> bool:
    return FIT_COLUMNS <= set(headline.columns)


def fit_answers(headline: pd.DataFrame) -> list[str]:
    """The answers' sentences: the largest value first, then the fastest engine at the value all reach."""
    ordered = headline.sort_values("answer_order", na_position="last") if "answer_order" in headline else headline
    return [line for text in ordered["answer"] if isinstance(text, str) for line in text.splitlines() if line]


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
    """The total, and under it the interval a prediction carries; a figure and its unit never part."""
    total = row["total_bytes"]
    if total is None or math.isnan(total):
        return ""
    shown = [format_bytes(int(value)).replace(" ", NO_BREAK) for value in (total, row.get("total_low"),
                                                                          row.get("total_high"))
             if value is not None and not math.isnan(value)]
    return shown[0] if len(shown) < 3 or shown[1] == shown[2] else f"{shown[0]} [{shown[1]}, {shown[2]}]"


def _time(row: dict) -> str:
    seconds = row["seconds_per_sample"]
    if seconds is None or math.isnan(seconds):
        return ""
    return f"{format_seconds(seconds).replace(' ', NO_BREAK)} ({row.get('time_basis') or 'measured'})"
