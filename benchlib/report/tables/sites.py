"""report.html's "Where the peak is" section: an attribution pass's sites, diffs and cost, per benchmark."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd

from benchlib.engine_names import REFERENCE
from benchlib.units import format_bytes, format_count
from benchlib.analysis.sites import ALL_SITES, NATIVE_SITE, attribution_cost, diff_table, own_first, site_table

CASES_SHOWN = 2  # cases whose top-site tables the page shows (closures have dozens; records keep all)
SITES_SHOWN = 8  # sites per engine in a table
DIFFS_SHOWN = 4  # diffs whose sites the page lists, those that differ most in total first
DIFF_SITES_SHOWN = 10


NBSP = "\u00a0"  # a number and its unit stay on one line


def _bytes(value: float) -> str:
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else \
        format_bytes(int(value)).replace(" ", NBSP)


def _signed_bytes(value: float) -> str:
    return ("+" if value > 0 else "") + format_bytes(int(value)).replace(" ", NBSP)


def _engines_first(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows by engine: eager torch (the reference) first, then the others by name; order kept within one."""
    key = frame["variant"].map(lambda engine: (engine != REFERENCE, engine))
    return frame.assign(_key=key).sort_values("_key", kind="stable").drop(columns="_key")


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, classes="table", na_rep="", escape=True)


def _via(row) -> str:
    return row["inner"] if row["inner"] else ""


def _site_rows(sites: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "engine": [engine.replace("-", "\u2011") for engine in sites["variant"]],  # no break at the hyphen
        "site": [f"{site} (yours)" if own else (f"{site} (no Python frame)" if site == NATIVE_SITE else site)
                 for site, own in zip(sites["site"], sites["own"])],
        "function": sites["function"],
        "allocated in": [_via(row) for _, row in sites.iterrows()],
        "bytes": [_bytes(v) for v in sites["bytes"]],
        "allocations": [format_count(int(v)) for v in sites["count"]],
        "share": [f"{100 * v:.1f}%" if np.isfinite(v) else "" for v in sites["share"].astype(float)],
    })


def own_line_sentences(sites: pd.DataFrame) -> list[str]:
    """Per engine, the user's own line holding most of the peak (or that none of theirs holds any)."""
    lines = []
    for engine, group in sites.groupby("variant", sort=False):
        own = group[group["own"].astype(bool)].sort_values("bytes", ascending=False)
        top = group.sort_values("bytes", ascending=False).iloc[0]
        if own.empty:
            lines.append(f"{engine}: none of your lines holds bytes at the peak; the largest site is {top['site']} in "
                         f"{top['function']} ({_bytes(top['bytes'])}, {100 * top['share']:.0f}%)")
            continue
        mine = own.iloc[0]
        via = f", allocated in {mine['inner']}" if mine["inner"] else ""
        other = "" if mine["site"] == top["site"] else \
            f"; the largest site is {top['site']} in {top['function']} ({_bytes(top['bytes'])}, {100 * top['share']:.0f}%)"
        lines.append(f"{engine}: your line holding most of the peak is {mine['site']} in {mine['function']}: "
                     f"{_bytes(mine['bytes'])}, {100 * mine['share']:.0f}% of the pass's peak{via}{other}")
    return lines


def _factor(value: float) -> str:
    return f"{value:.3g}x" if value < 1000 else f"{value:,.0f}x"


def _cost_text(records: pd.DataFrame) -> str:
    cost = attribution_cost(records)
    if cost.empty:
        return ""
    factor, call = cost["factor"].dropna(), cost["call_factor"].dropna()
    if factor.empty:
        return (f"<p>The attribution pass: {len(cost)} traced call(s), median {1e3 * cost['call_s'].median():.3g} ms "
                f"plus {1e3 * cost['read_s'].median():.3g} ms reading memray's records (no plain time to compare).</p>")
    reading = (cost["read_s"] / (cost["call_s"] + cost["read_s"])).median()
    return (f"<p><b>What the capture cost.</b> One extra pass per case, after the measured ones, so no number above "
            f"includes it: the traced call took {_factor(call.median())} a plain call's median (range "
            f"{_factor(call.min())} to {_factor(call.max())} over {len(call)} case(s) and engines) and, with reading "
            f"and grouping memray's records ({100 * reading:.0f}% of the pass, a fixed cost that dominates for short "
            f"calls), the whole capture {_factor(factor.median())} (range {_factor(factor.min())} to "
            f"{_factor(factor.max())}). Times are the <code>attribution_call_time</code> and "
            f"<code>attribution_read_time</code> records.</p>")


# benchlib's measure beside torch.profiler's category for the same memory (None: the other has no such row)
CATEGORY_ROWS = (("parameters", "role_parameter_bytes", "torch_parameter_bytes"),
                 ("optimizer state", "role_optimizer_bytes", "torch_optimizer_state_bytes"),
                 ("gradients", "role_gradient_bytes", "torch_gradient_bytes"),
                 ("saved activations", "role_saved_bytes", "torch_activation_bytes"),
                 ("temporaries", None, "torch_temporary_bytes"),
                 ("inputs (the batch)", None, "torch_input_bytes"),
                 ("autograd detail", None, "torch_autograd_detail_bytes"),
                 ("unknown to torch", None, "torch_unknown_bytes"),
                 ("peak: step's above the baseline / torch's total", "tracked_peak_bytes", "torch_peak_bytes"))


def categories_table(records: pd.DataFrame, case: str) -> pd.DataFrame:
    """One row per kind of memory; per engine of `case` two columns, benchlib's role and torch.profiler's
    category (medians over the trials that have them); empty when no engine has torch's categories."""
    rows = records[records["case"] == case]
    medians = rows.groupby(["variant", "metric"], sort=False)["value"].median()
    engines = list(dict.fromkeys(rows.loc[rows["metric"] == "torch_peak_bytes", "variant"]))
    if not engines:
        return pd.DataFrame()
    columns = pd.MultiIndex.from_tuples([(engine.replace("-", "\u2011"), source) for engine in engines
                                         for source in ("benchlib", "torch.profiler")])
    table = [[_bytes(medians.get((engine, metric))) if metric else "" for engine in engines
              for metric in (ours, theirs)] for _, ours, theirs in CATEGORY_ROWS]
    return pd.DataFrame(table, index=pd.Index([what for what, _, _ in CATEGORY_ROWS]),
                        columns=columns)


def sites_section(records: pd.DataFrame, benchmark: str) -> list[Any]:
    """The section's parts in page order: HTML strings and plotly figures; [] when `benchmark` has no
    attribution records."""
    from benchlib.report.plots.sites import peak_sites_figure

    rows = records[records["benchmark"] == benchmark]
    sites = _engines_first(site_table(rows))
    diffs = _engines_first(diff_table(rows))
    if sites.empty and diffs.empty:
        return []
    esc = html.escape
    python = rows.loc[rows["metric"] == "attribution_peak_bytes", "params"].str.contains('"python_allocators": true')
    traced = "both allocators (Python's small objects too)" if python.all() else \
        "the system allocator (buffers: NumPy and torch tensors, large Python objects)" if not python.any() else \
        "the system allocator, and for some cases Python's allocator too"
    parts = ["<h3>Where the peak is</h3>",
             f"<p>From the attribution pass (<code>--attribute</code>): one more call under memray, tracing {traced}, "
             "its records grouped by source line: your own line where one is on the stack (marked yours), else the "
             "innermost frame (a library's primitive, or torch's backward call for buffers the C++ autograd engine "
             "allocates). <i>allocated in</i> names the primitive under your line. Shares are of that pass's own "
             "peak.</p>", _cost_text(rows)]
    peak = sites[sites["kind"] == "peak"]
    cases = list(dict.fromkeys(peak["case"]))
    for case in cases[:CASES_SHOWN]:
        shown = peak[peak["case"] == case]
        title = f"case {case}" if len(cases) > 1 or case != "step" else "one step"
        sentences = own_line_sentences(shown) if sites["own"].astype(bool).any() else []  # a user's code only
        parts.append(f"<h4>Top sites at the peak, {esc(title)}</h4>"
                     + "".join(f"<p>{esc(line)}</p>" for line in sentences))
        table = pd.concat([own_first(group).head(SITES_SHOWN) for _, group in shown.groupby("variant", sort=False)])
        parts.append(_table(_site_rows(table)))
        parts.append(peak_sites_figure(shown, title=f"{benchmark}, {title}: bytes live at the peak by line, "
                                                     "engines side by side"))
        categories = categories_table(rows, case)
        if not categories.empty:
            parts.append("<h4>torch's categories beside benchlib's roles</h4><p>torch.profiler sorts every tensor it "
                         "saw by its use and is read at the moment its total is highest; benchlib's roles are each "
                         "read at their own most (gradients, saved activations) or as held before the step "
                         "(parameters, optimizer state), and its peak is the step's tracked peak above what was "
                         "held before it, so the columns need not agree (docs/measuring.md says where and why). "
                         "One more step each, outside the measured ones.</p>"
                         + categories.to_html(border=0, classes="table", na_rep="", escape=True))
        temporary = sites[(sites["kind"] == "temporary") & (sites["case"] == case)]
        if not temporary.empty:
            churn = pd.concat([group.sort_values("bytes", ascending=False).head(5)
                               for _, group in temporary.groupby("variant", sort=False)])
            parts.append("<h4>Temporaries: where each engine churns the allocator</h4><p>Allocations freed before "
                         "the next allocation was made (memray's temporary allocations), by site; shares are of all "
                         "temporary bytes of the engine's pass.</p>" + _table(_site_rows(churn)))
    if len(cases) > CASES_SHOWN:
        parts.append(f"<p>{len(cases) - CASES_SHOWN} more case(s) have sites in the records "
                     "(<code>benchlib.analysis.sites.site_table(records)</code>).</p>")
    if not diffs.empty:
        parts.append(_diff_html(diffs))
    return parts


def _diff_html(diffs: pd.DataFrame) -> str:
    keys = ["case", "variant", "of", "a", "b"]
    totals = diffs[diffs["site"] == ALL_SITES].copy()
    totals["order"] = -totals["bytes_diff"].abs() - 1e-9 * totals["count_diff"].abs()
    totals = totals.sort_values("order", kind="stable")
    several = totals["case"].nunique() > 1
    summary = pd.DataFrame({
        **({"case": totals["case"]} if several else {}),
        "engine": totals["variant"], "a": totals["a"], "b": totals["b"], "sites of": totals["of"],
        "bytes a": [_bytes(v) for v in totals["bytes_a"]], "bytes b": [_bytes(v) for v in totals["bytes_b"]],
        "difference": [_signed_bytes(v) for v in totals["bytes_diff"]],
        "allocations a → b": [f"{format_count(int(a))} → {format_count(int(b))}"
                              for a, b in zip(totals["count_a"], totals["count_b"])],
        "sites that differ": [int(((diffs[keys] == pd.Series(row[keys])).all(axis=1)
                                   & (diffs["site"] != ALL_SITES)).sum()) for _, row in totals.iterrows()],
    })
    parts = ["<h4>Site-by-site diffs</h4><p>Two allocation streams compared line by line (b minus a): "
             "for each pair, the totals, then the sites whose bytes or counts differ, largest difference first. "
             "Sites are matched by line and function, or, where the two streams' code sits at different lines (two "
             "closures, two versions of a file), by function and the primitive that allocated.</p>", _table(summary)]
    for _, total in totals[totals["change"] != "same"].head(DIFFS_SHOWN).iterrows():
        rows = diffs[(diffs[keys] == pd.Series(total[keys])).all(axis=1) & (diffs["site"] != ALL_SITES)]
        if rows.empty:
            continue
        rows = rows.head(DIFF_SITES_SHOWN)
        parts.append(f"<p><b>{html.escape(str(total['case']) + ', ' if several else '')}"
                     f"{html.escape(str(total['variant']))}: {html.escape(str(total['a']))} → "
                     f"{html.escape(str(total['b']))}</b> ({html.escape(str(total['of']))} sites)</p>" + _table(pd.DataFrame({
                         "site": rows["site"], "function": rows["function"], "allocated in": rows["inner"],
                         "bytes a": [_bytes(v) for v in rows["bytes_a"]], "bytes b": [_bytes(v) for v in rows["bytes_b"]],
                         "difference": [_signed_bytes(v) for v in rows["bytes_diff"]],
                         "allocations a → b": [f"{format_count(int(a))} → {format_count(int(b))}"
                                               for a, b in zip(rows["count_a"], rows["count_b"])],
                         "change": rows["change"]})))
    return "\n".join(parts)
