"""The answer report.html leads with: for each benchmark whose headline compares engines, one row per
engine (peak with its 95% interval, the ratio to the baseline with its interval, time with its interval,
gradient error, status with its whole reason) and, for a model file, the fastest engine under each memory
level. A table, not the terminal's lines, so nothing is clipped at the page's edge."""

from __future__ import annotations

import math

import pandas as pd

from benchlib.engine_names import COMBINED
from benchlib.records.metrics import COMPILE_COLUMN
from benchlib.units import format_bytes, format_seconds

ENGINE_HEADLINE = frozenset({"engine", "status", "peak_bytes", "time_s"})  # a headline that compares engines
ROW_STATUSES = ("frontier", "comparison")  # a model file's rows that are not one engine's
NO_BREAK = "\u00a0"


def _value(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _with_interval(row: pd.Series, column: str, low: str, high: str, show, show_bound=None) -> str:
    """`median [low, high]`, the bounds left out where the row has none (one trial, or the baseline itself)."""
    middle = _value(row.get(column))
    if math.isnan(middle):
        return ""
    bounds = [_value(row.get(low)), _value(row.get(high))]
    bound = show_bound or show
    text = show(middle) + ("" if any(math.isnan(b) for b in bounds) else f" [{bound(bounds[0])}, {bound(bounds[1])}]")
    return text.replace(" ", NO_BREAK)  # a value and its interval stay on one line; the reasons wrap


def _baseline(engines: pd.DataFrame, column: str) -> str | None:
    """The engine a ratio column is relative to: the one at exactly 1 with no interval, or a degenerate one."""
    for row in engines.itertuples():
        value = getattr(row, column, math.nan)
        low, high = (_value(getattr(row, f"{column}_low", math.nan)), _value(getattr(row, f"{column}_high", math.nan)))
        if _value(value) == 1.0 and (math.isnan(low) or low == high == 1.0):
            return str(row.engine)
    return None


def answer_table(headline: pd.DataFrame) -> pd.DataFrame | None:
    """One row per engine of an engine-comparing headline table; None for any other table."""
    if not ENGINE_HEADLINE <= set(headline.columns):
        return None
    engines = headline[headline["engine"].notna() & ~headline["status"].isin(ROW_STATUSES)]
    if engines.empty:
        return None
    case_column = next((column for column in ("version", "case") if column in engines
                        and engines[column].nunique() > 1), None)
    ratios = {column: _baseline(engines, column) for column in ("peak_ratio", "time_ratio") if column in engines}
    named = {name for name in engines.get("peak_ratio_to", ()) if isinstance(name, str) and name}
    if named:  # a model file names its best engine; versions of one file may each have another
        ratios["peak_ratio"] = named.pop() if len(named) == 1 else "its version's best"
    # a model file says which peak ranks its engines (the tracked one where resident peaks are below a page)
    ranked_by = next(iter(engines["peak_ratio_of"].dropna()), None) if "peak_ratio_of" in engines else None
    rows = []
    for _, row in engines.iterrows():
        reason = str(row.get("reason") or "").strip() if isinstance(row.get("reason"), str) else ""
        shown = {} if case_column is None else {case_column: row[case_column]}
        # a combination may wrap at its joins, never at a hyphen inside a technique's name
        shown["engine"] = str(row["engine"]).replace("-", "\u2011").replace(COMBINED, f"{COMBINED}\u200b")
        shown["peak above baseline"] = _with_interval(row, "peak_bytes", "peak_low", "peak_high", lambda v: format_bytes(int(v)))
        if "tracked_peak_bytes" in engines and engines["tracked_peak_bytes"].notna().any():
            tracked = _value(row.get("tracked_peak_bytes"))
            shown["tracked peak"] = "" if math.isnan(tracked) else format_bytes(int(tracked))
        for column, baseline in ratios.items():
            what = ranked_by if column == "peak_ratio" and ranked_by else column.removesuffix("_ratio")
            shown[f"{what} / {baseline}" if baseline else f"{what} ratio"] = _with_interval(
                row, column, f"{column}_low", f"{column}_high", "{:.2f}x".format, "{:.2f}".format)
        shown["time"] = _with_interval(row, "time_s", "time_low", "time_high", format_seconds)
        if COMPILE_COLUMN in engines and engines[COMPILE_COLUMN].notna().any():  # set-up, never in the time
            compile_s = _value(row.get(COMPILE_COLUMN))
            shown["compile (apart)"] = "" if math.isnan(compile_s) else format_seconds(compile_s)
        if "grad_max_rel_err" in engines:
            error = _value(row.get("grad_max_rel_err"))
            shown["gradient error"] = "" if math.isnan(error) else f"{error:.1e}"
        shown["status"] = str(row["status"]).replace("_", " ") + (f": {' '.join(reason.split())}" if reason else "")
        rows.append(shown)
    return pd.DataFrame(rows)


def fastest_table(headline: pd.DataFrame) -> pd.DataFrame | None:
    """A model file's frontier: under each memory level, the fastest engine whose gradient was checked."""
    if "fastest" not in headline or "status" not in headline:
        return None
    levels = headline[(headline["status"] == "frontier") & headline["fastest"].notna()]
    if levels.empty:
        return None
    rows = []
    for _, row in levels.iterrows():
        rows.append({**({"version": row["version"]} if "version" in levels and levels["version"].nunique() > 1 else {}),
                     "up to (peak)": format_bytes(int(row["peak_bytes"])), "fastest engine": row["fastest"],
                     "time": _with_interval(row, "time_s", "time_low", "time_high", format_seconds)})
    return pd.DataFrame(rows)
