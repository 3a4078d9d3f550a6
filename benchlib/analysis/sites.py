"""Allocation sites as records, tables and diffs: which line holds the peak, which churns the allocator.

An attribution pass (`benchlib.measure.allocations.attribute_allocations`, `--attribute`) groups what
memray saw by source line, three ways (`kind`): `peak` (bytes live at the pass's high-water mark),
`temporary` (allocations freed soon after they were made, memray's temporary allocations) and
`allocated` (every allocation the call made). `attribution_records` turns one pass into tidy
records: per site a `site_bytes` and a `site_count` row (repeat = the site's rank, params: kind, site,
function, file, line, inner frame, own = the user's code rather than Python's, a package's or
benchlib's), and per pass its cost (`attribution_call_time`, `attribution_read_time`), its peak and
the bytes of that peak no Python frame held (`attribution_unattributed_bytes`). `site_table` reads
them back as one row per site; `diff_sites` compares two site tables (two closures, two versions,
two engines), largest difference first; `diff_records` saves such a diff as records of kind `diff`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from benchlib.source_files import is_library, short_path

SITE_BYTES, SITE_COUNT = "site_bytes", "site_count"
DIFF_BYTES, DIFF_COUNT = "site_bytes_diff", "site_count_diff"
CALL_TIME, READ_TIME = "attribution_call_time", "attribution_read_time"
PASS_PEAK, UNATTRIBUTED = "attribution_peak_bytes", "attribution_unattributed_bytes"
SITE_METRICS = (SITE_BYTES, SITE_COUNT)
DIFF_METRICS = (DIFF_BYTES, DIFF_COUNT)
PASS_METRICS = (CALL_TIME, READ_TIME, PASS_PEAK, UNATTRIBUTED)
ATTRIBUTION_METRICS = frozenset(SITE_METRICS + DIFF_METRICS + PASS_METRICS)
KINDS = ("peak", "temporary", "allocated")
DIFF = "diff"
NATIVE_SITE = "<native>"  # what memray saw with no Python frame on the stack
ALL_SITES = "(all sites)"  # a diff's first row: the two streams' totals
RECORDED = 20  # sites of each kind, and differing sites of a diff, kept as records
SITE_COLUMNS = ["benchmark", "case", "variant", "kind", "rank", "site", "function", "inner", "own", "bytes", "count",
                "share", "file", "line"]
DIFF_COLUMNS = ["site", "function", "inner", "bytes_a", "bytes_b", "bytes_diff", "count_a", "count_b", "count_diff",
                "change"]


def site_label(file: str, line: int, function: str) -> str:
    """`model.py:12` (a library's file as `torch/autograd/graph.py:829`), or `<native>` for no Python frame."""
    if not file and function.startswith("<"):
        return NATIVE_SITE
    return f"{short_path(file)}:{line}"


def attribution_records(attribution: Mapping[str, Any], *, params: Mapping[str, Any] | None = None,
                        kept: int = RECORDED, **labels: Any) -> list[dict]:
    """One attribution pass (`Attribution.to_dict()`) as records with `labels` (make_record's) and
    `params` added to each row's own: its cost, its peak, and the `kept` largest sites of each kind."""
    from benchlib.records import make_record

    base = dict(params or {})
    shared = {**base, "python_allocators": bool(attribution.get("python_allocators", True))}
    rows = [make_record(**labels, metric=metric, value=float(attribution[key]), params=shared)
            for metric, key in ((CALL_TIME, "call_s"), (READ_TIME, "read_s"), (PASS_PEAK, "peak_bytes"),
                                (UNATTRIBUTED, "unattributed_bytes"))]
    for kind in KINDS:
        for rank, site in enumerate(attribution.get(kind, ())[:kept]):
            where = {"kind": kind, "site": site_label(site["file"], site["line"], site["function"]),
                     "function": site["function"], "file": site["file"], "line": int(site["line"]),
                     "inner": site.get("inner", ""), "own": bool(site["file"]) and not is_library(site["file"])}
            rows += [make_record(**labels, metric=SITE_BYTES, value=float(site["bytes"]), repeat=rank,
                                 params={**shared, **where}),
                     make_record(**labels, metric=SITE_COUNT, value=float(site["count"]), repeat=rank,
                                 params={**shared, **where})]
    return rows


def pass_sites(attribution: Mapping[str, Any], kind: str) -> pd.DataFrame:
    """One pass's sites of `kind` (from `Attribution.to_dict()`) as a site table: site, function, inner,
    own, bytes, count, file, line; what `diff_sites` compares."""

    rows = [{"site": site_label(site["file"], site["line"], site["function"]), "function": site["function"],
             "inner": site.get("inner", ""), "own": bool(site["file"]) and not is_library(site["file"]),
             "bytes": float(site["bytes"]), "count": float(site["count"]), "file": site["file"],
             "line": int(site["line"])} for site in attribution.get(kind, ())]
    return pd.DataFrame(rows, columns=["site", "function", "inner", "own", "bytes", "count", "file", "line"])


def _params(frame: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([json.loads(text) if text else {} for text in frame["params"]], index=frame.index)


def site_table(records: pd.DataFrame, kind: str | None = None) -> pd.DataFrame:
    """The site rows of `records` (a records frame) as one row per site: benchmark, case, variant
    (the engine), kind, rank, site, function, inner, own, bytes, count, share (of the pass's peak for
    `peak`, of all the kind's bytes otherwise), file, line. Empty (with these columns) when none."""
    rows = records[records["metric"].isin(SITE_METRICS)]
    if rows.empty:
        return pd.DataFrame(columns=SITE_COLUMNS)
    params = _params(rows)
    keyed = rows.assign(kind=params["kind"], site=params["site"], function=params["function"],
                        inner=params.get("inner", ""), own=params["own"].astype(bool), file=params["file"],
                        line=params["line"].astype(int), rank=rows["repeat"])
    if kind is not None:
        keyed = keyed[keyed["kind"] == kind]
    key = ["benchmark", "case", "variant", "kind", "rank", "site", "function", "inner", "own", "file", "line"]
    table = keyed.pivot_table(index=key, columns="metric", values="value", aggfunc="first").reset_index()
    table = table.rename(columns={SITE_BYTES: "bytes", SITE_COUNT: "count"})
    for column in ("bytes", "count"):
        if column not in table:
            table[column] = np.nan
    totals = table.groupby(["benchmark", "case", "variant", "kind"])["bytes"].transform("sum")
    peaks = records[records["metric"] == PASS_PEAK].groupby(["benchmark", "case", "variant"])["value"].first()
    peak_of = [peaks.get((b, c, v), np.nan) for b, c, v in zip(table["benchmark"], table["case"], table["variant"])]
    table["share"] = np.where(table["kind"] == "peak", table["bytes"] / pd.Series(peak_of, index=table.index),
                              table["bytes"] / totals)
    table = table.sort_values(["benchmark", "case", "variant", "kind", "rank"], kind="stable")
    return table[SITE_COLUMNS].reset_index(drop=True)


def own_first(sites: pd.DataFrame) -> pd.DataFrame:
    """Sites with the user's own lines first (largest first), then the others (Python's, a package's,
    benchlib's: the primitive or the backward call that allocated), largest first."""
    return sites.sort_values(["own", "bytes"], ascending=[False, False], kind="stable").reset_index(drop=True)


def diff_sites(a: pd.DataFrame, b: pd.DataFrame, by: Sequence[str] = ("site", "function")) -> pd.DataFrame:
    """Site by site, how stream `b` differs from stream `a` (two site tables: `bytes`, `count` and the
    `by` columns): each side summed over `by`, then bytes_a, bytes_b, bytes_diff = b - a and the counts
    likewise, and `change` (more, fewer, same bytes with another count: different, only in a, only in
    b, same), sorted by |bytes_diff| then |count_diff|, largest first."""
    by = list(by)
    for name, side in (("a", a), ("b", b)):
        missing = [column for column in (*by, "bytes", "count") if column not in side]
        if missing:
            raise ValueError(f"diff_sites: table {name} lacks {missing}; a site table has {', '.join(SITE_COLUMNS)}")
    carried = [column for column in ("site", "function", "inner") if column not in by]

    def summed(side: pd.DataFrame) -> pd.DataFrame:
        extra = {column: (column, "first") for column in carried if column in side}
        return side.groupby(by, dropna=False).agg(bytes=("bytes", "sum"), count=("count", "sum"), **extra).reset_index()

    merged = summed(a).merge(summed(b), on=by, how="outer", suffixes=("_a", "_b"), indicator=True)
    for column in carried:
        sides = [merged.pop(f"{column}_{name}") for name in ("a", "b") if f"{column}_{name}" in merged]
        merged[column] = sides[0].combine_first(sides[1]) if len(sides) == 2 else sides[0] if sides else ""
    side = merged.pop("_merge")
    for column in ("bytes", "count"):
        merged[f"{column}_a"] = merged[f"{column}_a"].fillna(0.0)
        merged[f"{column}_b"] = merged[f"{column}_b"].fillna(0.0)
        merged[f"{column}_diff"] = merged[f"{column}_b"] - merged[f"{column}_a"]
    change = np.select(
        [side == "left_only", side == "right_only", merged["bytes_diff"] > 0, merged["bytes_diff"] < 0,
         merged["count_diff"] != 0],
        ["only in a", "only in b", "more", "fewer", "different"], default="same")
    merged["change"] = change
    for column in ("site", "function", "inner"):
        if column not in merged:
            merged[column] = ""
        merged[column] = merged[column].fillna("")
    order = np.lexsort((-merged["count_diff"].abs().to_numpy(), -merged["bytes_diff"].abs().to_numpy()))
    return merged.iloc[order][DIFF_COLUMNS].reset_index(drop=True)


def diff_records(diff: pd.DataFrame, *, a: str, b: str, of: str, kept: int = RECORDED,
                 params: Mapping[str, Any] | None = None, **labels: Any) -> list[dict]:
    """A `diff_sites` table as records of kind `diff`: first the two streams' totals (site `(all sites)`,
    so a diff where nothing differs still says so), then per site (the `kept` largest differences that
    are not `same`) a `site_bytes_diff` and a `site_count_diff` row (b - a), params naming the two
    streams (`a`, `b`), which kind of site they compare (`of`) and both sides' bytes and counts."""
    from benchlib.records import make_record

    rows = []
    totals = {column: float(diff[column].sum()) for column in ("bytes_a", "bytes_b", "count_a", "count_b")}
    total = pd.DataFrame([{"site": ALL_SITES, "function": "", "inner": "", **totals,
                           "bytes_diff": totals["bytes_b"] - totals["bytes_a"],
                           "count_diff": totals["count_b"] - totals["count_a"]}])
    total["change"] = np.select([total["bytes_diff"] > 0, total["bytes_diff"] < 0, total["count_diff"] != 0],
                                ["more", "fewer", "different"], default="same")
    changed = pd.concat([total, diff[diff["change"] != "same"].head(kept)], ignore_index=True)
    for rank, row in enumerate(changed[DIFF_COLUMNS].itertuples(index=False)):
        where = {**(params or {}), "kind": DIFF, "of": of, "a": a, "b": b, "site": row.site, "function": row.function,
                 "inner": row.inner, "change": row.change, "bytes_a": float(row.bytes_a),
                 "bytes_b": float(row.bytes_b), "count_a": float(row.count_a), "count_b": float(row.count_b)}
        rows += [make_record(**labels, metric=DIFF_BYTES, value=float(row.bytes_diff), repeat=rank, params=where),
                 make_record(**labels, metric=DIFF_COUNT, value=float(row.count_diff), repeat=rank, params=where)]
    return rows


def diff_table(records: pd.DataFrame) -> pd.DataFrame:
    """The `diff` records as one row per site: benchmark, case, variant, of, a, b, site, function, inner,
    bytes_a, bytes_b, bytes_diff, count_diff, change; in the order they were saved."""
    rows = records[records["metric"].isin(DIFF_METRICS)]
    columns = ["benchmark", "case", "variant", "of", "a", "b", "site", "function", "inner", "bytes_a", "bytes_b",
               "bytes_diff", "count_a", "count_b", "count_diff", "change"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    params = _params(rows)
    keyed = rows.assign(**{name: params[name] for name in ("of", "a", "b", "site", "function", "inner", "change",
                                                           "bytes_a", "bytes_b", "count_a", "count_b")},
                        rank=rows["repeat"])
    key = ["benchmark", "case", "variant", "of", "a", "b", "rank", "site", "function", "inner", "change", "bytes_a",
           "bytes_b", "count_a", "count_b"]
    table = keyed.pivot_table(index=key, columns="metric", values="value", aggfunc="first", sort=False).reset_index()
    table = table.rename(columns={DIFF_BYTES: "bytes_diff", DIFF_COUNT: "count_diff"})
    return table[columns].reset_index(drop=True)


PLAIN_TIMES = ("time", "warm_time")  # a plain (untraced, warm) call of a case, by the benchmark's metric


def attribution_cost(records: pd.DataFrame) -> pd.DataFrame:
    """What each attribution pass cost: per benchmark, case and variant, the traced call (`call_s`), the
    reading of its records (`read_s`), the median plain call of the same case (`plain_s`, from `time` or
    `warm_time` records), `call_factor` = call_s / plain_s (tracing's slowdown) and `factor` =
    (call_s + read_s) / plain_s: the whole capture as a multiple of a plain step."""
    passes = records[records["metric"].isin((CALL_TIME, READ_TIME))]
    columns = ["benchmark", "case", "variant", "call_s", "read_s", "plain_s", "call_factor", "factor"]
    if passes.empty:
        return pd.DataFrame(columns=columns)
    keys = ["benchmark", "case", "variant"]
    table = passes.pivot_table(index=keys, columns="metric", values="value", aggfunc="median").reset_index()
    table = table.rename(columns={CALL_TIME: "call_s", READ_TIME: "read_s"})
    plain = records[records["metric"].isin(PLAIN_TIMES)].groupby(keys)["value"].median().rename("plain_s")
    table = table.merge(plain.reset_index(), on=keys, how="left")
    table["call_factor"] = table["call_s"] / table["plain_s"]
    table["factor"] = (table["call_s"] + table["read_s"]) / table["plain_s"]
    return table[columns]
