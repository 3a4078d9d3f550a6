"""report.html: the one page to open after a run.

A run directory holds many figures, tables and executed notebooks; this page ties them together:
the environment that shaped the numbers, the seed verdicts, then one section per notebook with
its question, its headline tables and every figure it saved. It carries one inline copy of
plotly.js and the figures' JSON, so it opens offline from the file system and can be mailed on
its own. When the page has drawn every figure it sets `data-figures-rendered` on <body>; script
errors are collected in `data-script-errors`, so a headless browser can check the page.
"""

from __future__ import annotations

import html
import json
import re
import os
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd

from benchlib.analysis.seed_verdicts import QUICK_CAVEAT, load_verdicts
from benchlib.records.places import RUN_INFO
from benchlib.records.store import load_run_info, resolve_run, write_text_atomic
from benchlib.report.tables.compact import constant_columns_apart, every_row_text
from benchlib.report.tables.fit import is_fit_headline

REPORT = "report.html"
HEADLINE_SUFFIX = "_headline"  # tables/<notebook>_headline.parquet are shown in the notebook's section
SUMMARY_COLUMN = "summary"  # a headline table with this column holds one line of text per row: printed after a run
_OTHER = "other figures"
GRID_SECTION = "parameter grid"  # figures named grid_* (benchlib run --grid): metric against the grid's parameters


def figure_names(run_path: Path) -> list[str]:
    """The figures a run saved (figures/<name>.json), sorted."""
    return sorted(path.stem for path in (run_path / "figures").glob("*.json"))


def group_by_notebook(names: Sequence[str], notebooks: Sequence[str],
                      benchmarks: Mapping[str, Sequence[str]] | None = None) -> dict[str, list[str]]:
    """Figure or table names under the notebook whose name, or the name of a benchmark it wrote (`benchmarks`,
    run.json's), is their longest prefix; the rest under 'other figures'.

    Notebooks name what they save after themselves (`dot_chain_peak`) or after their benchmark (the your_model
    notebook saves `my_mlp_peak` for a model file named my_mlp), so no extra index is needed.
    """
    groups: dict[str, list[str]] = {notebook: [] for notebook in notebooks}
    owners = {notebook: notebook for notebook in notebooks}
    for notebook, written in (benchmarks or {}).items():
        owners.update({benchmark: notebook for benchmark in written if benchmark not in owners})
    by_length = sorted(owners, key=len, reverse=True)
    for name in names:
        prefix = next((p for p in by_length if name == p or name.startswith(f"{p}_")), None)
        owner = owners[prefix] if prefix else GRID_SECTION if name.startswith("grid_") else _OTHER
        groups.setdefault(owner, []).append(name)
    return groups


def written_benchmarks(info: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per notebook, the benchmarks whose records it wrote (run.json; none in runs made before it was kept)."""
    return {name: [b for b in entry.get("benchmarks") or [] if isinstance(b, str)]
            for name, entry in info.get("notebooks", {}).items() if isinstance(entry, Mapping)}


def notebook_question(run_path: Path, notebook: str, info: Mapping[str, Any]) -> str:
    """What a section's benchmark asks: its declaration's question as run.json keeps it, else (older runs)
    the first markdown paragraph of the notebook (executed copy, else the source)."""
    declared = info.get("benchmarks", {}).get(notebook.split("@")[0], {})
    if declared.get("question"):
        seed = declared.get("seed") or {}
        return declared["question"] + (f" Seed: {seed['title']}." if seed.get("title") else "")
    candidates = [run_path / "notebooks" / f"{notebook}.ipynb"]
    if info.get("notebooks_dir"):
        candidates.append(Path(info["notebooks_dir"]) / f"{notebook}.ipynb")
    for path in candidates:
        if not path.is_file():
            continue
        try:
            import nbformat  # here, not at import: it costs a second (its schema checks) to every importer

            cells = nbformat.read(path, as_version=4).cells
        except Exception:  # an unreadable notebook must not stop the report; the section says so
            return f"(the notebook {path.name} could not be read)"
        for cell in cells:
            if cell.cell_type == "markdown" and cell.source.strip():
                paragraphs = [p.strip() for p in cell.source.split("\n\n") if p.strip()]
                text = " ".join(p.lstrip("#").strip() for p in paragraphs[:2])
                return re.sub(r"[*`]", "", text)  # the page shows text: drop markdown emphasis and code marks
    return ""



def _allocator_text(allocator: dict) -> str:
    """What shaped the allocator's numbers, where anything was set: the isolation's policy (the processes a run
    measured in) and the variables set; nothing where neither was (a fit, a run that isolated nothing)."""
    policy, variables = allocator.get("isolation_default_policy"), allocator.get("env") or {}
    said = ([f"allocator policy {policy}"] if policy else []) + \
        ([f"allocator environment {json.dumps(variables)}"] if variables else [])
    return "".join(f"; {part}" for part in said)

def _environment_lines(info: Mapping[str, Any]) -> list[str]:
    """A few lines naming what shaped the numbers: device, versions, commit, allocator, threads, data."""
    env = info.get("environment", {})
    packages = env.get("packages", {})
    cpu = env.get("cpu", {})
    gpu = env.get("gpu", {})
    git = env.get("git", {})
    allocator = env.get("allocator", {})
    gpu_text = ", ".join(d.get("name", "?") for d in gpu.get("devices", [])) if gpu.get("available") else gpu.get("note", "none")
    versions = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    commit = (git.get("commit") or "unknown")[:12] + (" (dirty tree)" if git.get("dirty") else "")
    lines = [
        f"device {info.get('device')} (asked: {info.get('device_requested', info.get('device'))}); "
        f"host {env.get('host', '?')}, {cpu.get('model', '?')}, {cpu.get('usable_cores', '?')} usable cores, "
        f"{env.get('torch_threads', '?')} torch threads; GPU: {gpu_text}",
        f"Python {env.get('python', {}).get('version', '?')}; {versions}",
        f"commit {commit}" + _allocator_text(allocator),
    ]
    sources = info.get("data_sources") or info.get("data_source")
    if sources:
        lines.append(f"data: {json.dumps(sources) if not isinstance(sources, str) else sources}")
    if info.get("quick"):
        lines.append("quick sizes (--quick): a first look, not the default sizes")
    return lines


def _status_table(info: Mapping[str, Any]) -> pd.DataFrame:
    rows = []
    for name, entry in info.get("notebooks", {}).items():
        error = (entry.get("error") or "").splitlines()
        rows.append(
            {
                "notebook": name,
                "status": entry.get("status"),
                "duration (s)": entry.get("duration_s"),
                "error": error[0][:160] if error else "",
            }
        )
    return pd.DataFrame(rows, columns=["notebook", "status", "duration (s)", "error"])


def table_html(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, classes="table", na_rep="", float_format=lambda v: f"{v:.4g}")


def summary_lines(run_path: Path, section: str) -> list[str]:
    """The one-line rows of a section's headline table (its `summary` column), [] when it has none."""
    path = run_path / "tables" / f"{section}{HEADLINE_SUFFIX}.parquet"
    try:
        frame = pd.read_parquet(path)
    except Exception:  # no table, or an unreadable one: the report says which; the terminal just has no lines
        return []
    return [str(line) for line in frame[SUMMARY_COLUMN]] if SUMMARY_COLUMN in frame else []


def _headline_tables(run_path: Path, tables: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    shown = []
    for name in tables:
        if name.endswith(HEADLINE_SUFFIX):
            try:
                shown.append((name, pd.read_parquet(run_path / "tables" / f"{name}.parquet")))
            except Exception as error:  # keep the page: say which file is unreadable
                shown.append((name, pd.DataFrame({"unreadable table": [f"{name}.parquet: {error}"]})))
    return shown


_STYLE = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1250px;
       color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 4px; } pre.answer { background: #f6f8fa; padding: 8px 12px; overflow-x: auto; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 36px; }
.env { color: #444; font-size: 0.92em; margin: 2px 0; }
.question { font-style: italic; color: #333; }
.warning { background: #fff4e0; border-left: 4px solid #e08a00; padding: 6px 10px; }
table.table { border-collapse: collapse; font-size: 0.9em; margin: 8px 0 16px; }
table.table th, table.table td { padding: 3px 10px; border-bottom: 1px solid #e3e3e3; text-align: left; }
table.table th { background: #f4f4f4; }
.answer-line { font-weight: 600; margin: 4px 0; }
table.fit td { white-space: normal !important; overflow-wrap: anywhere; } table.fit td:first-child { min-width: 9em; }
table.answer { width: 100%; } table.answer td { vertical-align: top; white-space: nowrap; } table.answer td:first-child { white-space: normal; } table.answer td:last-child { white-space: normal; overflow-wrap: anywhere; min-width: 12em; }
.wide { overflow-x: auto; }
.status-ok { color: #1a7f37; } .status-failed, .status-partial, .status-interrupted { color: #b42318; font-weight: bold; }
.figure { border: 1px solid #eee; margin: 12px 0; min-height: 420px; }
nav a { margin-right: 14px; }
"""

_RENDER_SCRIPT = """
(function () {
  var errors = [];
  window.addEventListener('error', function (e) { errors.push(String(e.message)); report(); });
  function report() { document.body.setAttribute('data-script-errors', JSON.stringify(errors)); }
  report();
  var specs = JSON.parse(document.getElementById('figure-data').textContent);
  var drawn = 0;
  var pending = specs.map(function (spec) {
    var target = document.getElementById(spec.id);
    try {
      var figure = spec.figure;
      var layout = Object.assign({}, figure.layout || {}, {autosize: true});
      return Plotly.newPlot(target, figure.data || [], layout, {responsive: true}).then(function () { drawn += 1; })
        .catch(function (e) { errors.push(spec.id + ': ' + e); });
    } catch (e) { errors.push(spec.id + ': ' + e); return Promise.resolve(); }
  });
  Promise.all(pending).then(function () {
    document.body.setAttribute('data-figures-rendered', String(drawn)); report();
  });
})();
"""


def _verdict_section(run_path: Path) -> str:
    """The run's saved seed verdicts (`verdicts.parquet`), or why there are none; "" when no seed rule applies."""
    try:
        verdicts = load_verdicts(run_path)
    except Exception as error:  # a damaged table must not cost the rest of the page
        return f"<p>No verdicts: {html.escape(f'{type(error).__name__}: {error}')}</p>"
    if verdicts is None:
        return "<p>No verdicts saved with this run (the run did not finish; <code>benchlib report RUN</code> " \
               "judges its records and writes them).</p>"
    if verdicts.empty:
        return ""
    shown = verdicts.rename(columns={"ci_low": "95% CI low", "ci_high": "95% CI high"})
    columns = ["verdict", "claim", *(["group"] if verdicts["group"].astype(bool).any() else []),
               *(["grid_point"] if verdicts["grid_point"].astype(bool).any() else []),
               "ratio", "95% CI low", "95% CI high", "baseline",
               *(["reason"] if "reason" in verdicts and verdicts["reason"].astype(bool).any() else []), "rule"]
    return table_html(shown[columns])


def _run_link(run_path: Path, text: str) -> str:
    """A link for a relative path inside the run directory, escaped text for anything else: run.json is
    data, and a `javascript:` or outside URL in it must not become a live link in the page."""
    inside = (text and text.isprintable() and text == text.strip() and ":" not in text and not Path(text).is_absolute()
              and (run_path / text).resolve().is_relative_to(run_path.resolve()))
    if not inside:
        return html.escape(text)
    return f"<a href='{html.escape(quote(text, safe='/'))}'>{html.escape(text)}</a>"


def _records(run_path: Path) -> tuple[pd.DataFrame | None, str]:
    """The run's records, or None and why they cannot be read (the page still shows everything else, and says so)."""
    from benchlib.records.store import RecordsUnreadable, load_records

    try:
        return load_records(run_path), ""
    except RecordsUnreadable as error:  # it names the file and why
        return None, str(error)
    except Exception as error:  # noqa: BLE001 - a damaged file costs the measurements' parts, said at the top
        return None, f"{type(error).__name__}: {error}"


def _part_html(build, what: str, records: pd.DataFrame, benchmark: str, figure_specs: list[dict[str, Any]]) -> str:
    """A part of a benchmark's section that `build(records, benchmark)` makes of HTML strings and figures (where
    the peak is; which module holds the memory), its figures added to the page's."""
    try:
        section = build(records, benchmark)
    except Exception as error:  # a damaged table must not cost the rest of the page
        return f"<p>{html.escape(what)} could not be shown: {html.escape(f'{type(error).__name__}: {error}')}</p>"
    parts = []
    for part in section:
        if isinstance(part, str):
            parts.append(part)
            continue
        figure_id, name = f"figure-{len(figure_specs)}", f"{benchmark}_{build.__name__}_{len(parts)}"
        figure_specs.append({"id": figure_id, "name": name, "figure": json.loads(part.to_json())})
        parts.append(f"<div class='figure' id='{figure_id}' data-name='{html.escape(name)}'></div>")
    return "\n".join(parts)


def build_report(run: str | os.PathLike) -> str:
    """The report page of a run directory (or run id) as one HTML string."""
    from benchlib.analysis.sites import ATTRIBUTION_METRICS
    from benchlib.report.tables.harness import harness_section

    run_path = resolve_run(run)
    info = load_run_info(run_path)
    notebooks = list(info.get("notebooks", {}))
    written = written_benchmarks(info)
    owned = {*notebooks, *(b for names in written.values() for b in names)}
    # records of a benchmark no notebook claims (a model file's, in runs made before run.json named them): a section
    unclaimed = sorted(path.stem for path in (run_path / "records").glob("*.parquet") if path.stem not in owned)
    figures = group_by_notebook(figure_names(run_path), [*notebooks, *unclaimed], written)
    table_names = sorted(path.stem for path in (run_path / "tables").glob("*.parquet"))
    tables = group_by_notebook(table_names, [*notebooks, *unclaimed], written)
    sections = [name for name in figures if figures[name] or name in notebooks or tables.get(name)]
    headlines = {section: _headline_tables(run_path, tables.get(section, [])) for section in sections}
    records, unreadable = _records(run_path)
    attributed = records if records is not None and records["metric"].isin(ATTRIBUTION_METRICS).any() else None
    page = _Page(run_path, info, figure_specs=[])
    parts = page.opening(sections, headlines)
    if unreadable:
        parts.insert(1, f"<p class='problem'><b>The run's records could not be read</b>, so what was measured is not "
                        f"shown below: {html.escape(unreadable)}</p>")
    for section in sections:
        parts += page.section(section, headlines[section], figures.get(section, []))
        for benchmark in dict.fromkeys([section.split("@")[0], *written.get(section, [])]):
            parts += page.measured_parts(benchmark, records, attributed)
    # how far to trust the figures above, and what measuring them cost: after the answers they qualify
    noise_path = run_path / "tables" / "noise.parquet"
    if noise_path.is_file():
        noise = pd.read_parquet(noise_path)
        parts.append("<h2 id='noise'>Noise warnings</h2><p>Timed measurements whose trials spread too much "
                     "(coefficient of variation above 10%, max/min above 1.5), hold a robust outlier, or began with "
                     "the load average above the cores: read their ratios with care.</p>"
                     + (table_html(_readable_noise(noise)) if not noise.empty else "<p>None flagged.</p>"))
    if records is not None:
        parts.append(harness_section(records))
    return html_page(f"benchlib run {info.get('run_id', run_path.name)}", parts, page.figure_specs)


@dataclass
class _Page:
    """The report of one run being written: its folder, its run.json, and the figures placed so far (drawn by
    the page's script from their specs)."""

    run_path: Path
    info: dict
    figure_specs: list[dict[str, Any]]

    def opening(self, sections: list[str], headlines: dict) -> list[str]:
        """The title, the environment, the sections' links, the answers, the notebooks' status, the verdicts."""
        esc, info, run_path = html.escape, self.info, self.run_path
        parts = [f"<h1>benchlib run {esc(info.get('run_id', run_path.name))}</h1>",
                 f"<p class='env'>started {esc(str(info.get('started_at')))}, ended "
                 f"{esc(str(info.get('ended_at') or 'not finished'))}</p>"]
        parts += [f"<p class='env'>{esc(line)}</p>" for line in _environment_lines(info)]
        parts.append("<nav>" + "".join(f"<a href='#{esc(name)}'>{esc(name)}</a>" for name in sections) + "</nav>")
        answers = [(section, _answer_html(frame)) for section, shown in headlines.items() for _, frame in shown]
        if any(answer for _, answer in answers):  # the answer first: each engine-comparing benchmark's table
            parts.append("<h2 id='answers'>Answers</h2>" + "".join(
                f"<p><a href='#{esc(section)}'>{esc(section)}</a></p>{answer}" for section, answer in answers if answer))
        parts.append("<h2 id='status'>Notebooks</h2>" + table_html(_status_table(info)))
        verdicts = _verdict_section(run_path)
        if verdicts:  # left out where no seed rule applies to what the run measured
            judged = "<table" in verdicts
            parts.append("<h2 id='verdicts'>Seed verdicts</h2>"
                         "<p>Did this run reproduce each seed's claim? The ratio's 95% interval inside the claimed "
                         "range reproduces it, wholly outside refutes it, anything else (one trial a side, too much "
                         "noise) is inconclusive.</p>"
                         + (f"<p class='warning'>{esc(QUICK_CAVEAT[0].upper() + QUICK_CAVEAT[1:])}.</p>"
                            if info.get("quick") and judged else "")
                         + verdicts)
        return parts

    def section(self, section: str, headlines: list, figures: list[str]) -> list[str]:
        """A notebook's section: its question, status, headline tables and figures."""
        esc, run_path = html.escape, self.run_path
        entry = self.info.get("notebooks", {}).get(section, {})
        parts = [f"<h2 id='{esc(section)}'>{esc(section)}</h2>"]
        question = notebook_question(run_path, section, self.info) if section in self.info.get("notebooks", {}) else ""
        if question:
            parts.append(f"<p class='question'>{esc(question)}</p>")
        if entry:
            status = entry.get("status", "?")
            line = f"status <span class='status-{esc(status)}'>{esc(status)}</span>"
            if entry.get("duration_s") is not None:
                line += f", {entry['duration_s']:.0f} s"
            if entry.get("output"):
                line += f"; executed notebook: {_run_link(run_path, str(entry['output']))}"
            parts.append(f"<p>{line}</p>")
        parts += [_headline_html(name, frame) for name, frame in headlines]
        for name in figures:
            figure_id = f"figure-{len(self.figure_specs)}"
            figure_json = json.loads((run_path / "figures" / f"{name}.json").read_text(encoding="utf-8"))
            self.figure_specs.append({"id": figure_id, "name": name, "figure": figure_json})
            parts.append(f"<div class='figure' id='{figure_id}' data-name='{esc(name)}'></div>")
        return parts

    def measured_parts(self, benchmark: str, records: pd.DataFrame | None,
                       attributed: pd.DataFrame | None) -> list[str]:
        """What a benchmark's records say beyond its headline: CUDA's allocator, memory per rank and by module,
        allocation sites."""
        from benchlib.report.tables.cuda import allocator_section
        from benchlib.report.tables.modules import modules_section
        from benchlib.report.tables.ranks import ranks_section
        from benchlib.report.tables.sites import sites_section

        parts = []
        if records is not None:
            parts.append(allocator_section(records, benchmark, self.run_path))
            parts.append(_part_html(ranks_section, "Memory per rank", records, benchmark, self.figure_specs))
            parts.append(_part_html(modules_section, "Memory by module", records, benchmark, self.figure_specs))
        if attributed is not None:
            parts.append(_part_html(sites_section, "Allocation sites", attributed, benchmark, self.figure_specs))
        return parts


def _headline_html(name: str, frame: pd.DataFrame) -> str:
    """One headline table: a fit's answer points to the top, an answer shows as at the top with every column
    folded away, any other table with its constant columns said once."""
    esc = html.escape
    answer = _answer_html(frame)
    if answer and is_fit_headline(frame):  # shown once, at the top: here the figure and every column
        return (f"<p><a href='#answers'>The answer is at the top.</a></p><details><summary>{esc(name)}: "
                "every column</summary>" + table_html(frame) + "</details>")
    if answer:  # the answer, as at the top; the full table folds away
        return (answer + f"<details><summary>{esc(name)}: every column</summary>"
                + table_html(frame.drop(columns=[SUMMARY_COLUMN], errors="ignore")) + "</details>")
    shown, same = constant_columns_apart(frame)
    return (f"<h3>{esc(name)}</h3>" + (f"<p class='env'>{esc(every_row_text(same))}</p>" if same else "")
            + "<div class='wide'>" + table_html(shown) + "</div>")


def _answer_html(headline: pd.DataFrame) -> str:
    """An engine-comparing headline as the answer table (and a model file's fastest engine per memory level), a
    fit's as its answers and table; "" for any other headline."""
    from benchlib.report.tables.answers import answer_table, fastest_table
    from benchlib.report.tables.fit import fit_answers, fit_table, is_fit_headline

    if is_fit_headline(headline):
        return ("".join(f"<p class='answer-line'>{html.escape(line)}</p>" for line in fit_answers(headline))
                + "<div class='wide'>" + table_html(fit_table(headline)).replace(
                    "class=\"dataframe table\"", "class=\"dataframe table answer fit\"") + "</div>")
    answer = answer_table(headline)
    if answer is None:  # a headline of its own shape: its summary lines, if it has them, as they are
        lines = map(str, headline[SUMMARY_COLUMN]) if SUMMARY_COLUMN in headline else ()
        text = "\n".join(lines)
        return f"<pre class='answer'>{html.escape(text)}</pre>" if text else ""
    fastest = fastest_table(headline)
    return ("<div class='wide'>" + table_html(answer).replace("class=\"dataframe table\"", "class=\"dataframe table answer\"") + "</div>"
            + ("" if fastest is None else "<p>Fastest within a memory level (engines whose gradient was checked):</p>"
               + table_html(fastest)))


NOISE_CONFIG_HIDDEN = ("malloc_env",)  # what the allocator policy already names


def _readable_noise(noise: pd.DataFrame) -> pd.DataFrame:
    """The noise table with each configuration as `name=value` words rather than raw JSON."""
    shown = noise.drop(columns=["dimension", "device", "unit"], errors="ignore").copy()
    if "config" in shown:
        def words(text):
            try:
                config = json.loads(text) if isinstance(text, str) and text else {}
            except ValueError:
                return text
            return ", ".join(f"{key}={value}" for key, value in config.items() if key not in NOISE_CONFIG_HIDDEN)
        shown["config"] = shown["config"].map(words)
    return shown


def html_page(title: str, parts: Sequence[str], figure_specs: Sequence[Mapping[str, Any]]) -> str:
    """A page of HTML `parts` whose figures (`{"id", "name", "figure"}`, drawn into the element of that
    id) come with one inline plotly.js, so it opens offline; `benchlib history` writes one too."""
    from plotly.offline import get_plotlyjs

    # '</' inside JSON would end the <script> element early; JSON allows the escaped form.
    data = json.dumps(list(figure_specs)).replace("</", "<\\/")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>"
        f"<script>{get_plotlyjs()}</script></head>\n<body data-figures='{len(figure_specs)}'>\n"
        + "\n".join(parts)
        + f"\n<script type='application/json' id='figure-data'>{data}</script>\n<script>{_RENDER_SCRIPT}</script>\n</body></html>\n"
    )


def write_report(run: str | os.PathLike) -> Path:
    """Write `<run>/report.html` (atomically) and return its path."""
    run_path = resolve_run(run)
    if not (run_path / RUN_INFO).is_file():
        raise FileNotFoundError(f"{run_path} has no run.json: a report needs the run's metadata")
    return write_text_atomic(build_report(run_path), run_path / REPORT, make_folder=False)
