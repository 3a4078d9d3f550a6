"""JupyterLab as a user meets it: `benchlib lab` on working copies, a notebook run through the UI at its
quick sizes, its figures drawn, a finished run with a report, and the shipped notebook untouched."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from benchlib.records.store import list_runs
from benchlib.registry import get
from benchlib.runner.commands.running import working_copies
from benchlib.runner.arguments import RunnerError
from benchlib.runner.notebooks import find_project_notebooks

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BENCHLIB = Path(sys.executable).with_name("benchlib")
NOTEBOOK = "dot_chain"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def test_working_copies_are_made_once_and_an_edited_one_is_kept_and_named(tmp_path):
    copied, edited = working_copies(tmp_path / "lab", None)
    assert NOTEBOOK in copied and not edited
    copy = tmp_path / "lab" / f"{NOTEBOOK}.ipynb"
    notebook = nbformat.read(copy, as_version=4)
    notebook.cells[1].outputs = [nbformat.v4.new_output("stream", text="outputs alone are no edit")]
    nbformat.write(notebook, copy)
    assert working_copies(tmp_path / "lab", None) == ([], [])
    notebook.cells[1].source += "\nquick = True"
    nbformat.write(notebook, copy)
    assert working_copies(tmp_path / "lab", None) == ([], [NOTEBOOK])
    assert "quick = True" in copy.read_text()  # kept, never overwritten
    with pytest.raises(RunnerError, match="is the shipped notebooks' folder"):
        working_copies(find_project_notebooks(), None)
    with pytest.raises(RunnerError, match="is the shipped notebooks' folder or inside it"):
        working_copies(find_project_notebooks() / "mine", None)


def test_notebooks_and_lab_never_write_through_a_link_or_into_a_file(tmp_path, capsys):
    from benchlib.runner.cli import main

    folder, outside = tmp_path / "copies", tmp_path / "outside.ipynb"
    folder.mkdir()
    (folder / f"{NOTEBOOK}.ipynb").symlink_to(outside)  # dangling: exists() says free
    assert main(["notebooks", str(folder)]) == 2
    assert "never overwrites a notebook, nor writes through a link" in capsys.readouterr().err
    with pytest.raises(RunnerError, match="which does not exist; benchlib never writes through a link"):
        working_copies(folder, None)
    assert not outside.exists()
    (tmp_path / "file").write_text("")
    assert main(["notebooks", str(tmp_path / "file")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    with pytest.raises(RunnerError, match="is a file; give a folder"):
        working_copies(tmp_path / "file", None)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_server(url: str, lab: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.poll() is not None:
            pytest.fail(f"benchlib lab exited with {lab.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.serial  # a browser's Run All, timed out beside busy workers
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it where it runs as root)")
def test_a_notebook_run_all_in_jupyterlab_at_quick_sizes_draws_its_figures_and_leaves_the_shipped_one_clean(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (the dev extra)")
    shipped = find_project_notebooks() / f"{NOTEBOOK}.ipynb"
    before = shipped.read_bytes()
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell drawn, so each prompt can be read (JupyterLab draws only the visible ones by default)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = _free_port(), "benchlib-test"
    env = {**os.environ, "BENCHLIB_RESULTS": str(tmp_path / "results"), "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    log = tmp_path / "lab.log"
    with log.open("w") as output:
        lab = subprocess.Popen([str(BENCHLIB), "lab", "--dir", str(tmp_path / "lab"), "--", "--no-browser",
                                f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"],
                               env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/status?token={token}", lab, log)
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}.ipynb?token={token}")
            panel = ".jp-NotebookPanel"
            page.wait_for_selector(f"{panel} [data-status='idle']", timeout=90_000)  # the kernel started
            page.locator(f"{panel} .jp-CodeCell .cm-content").first.click()  # the parameters cell, as a user edits it
            page.keyboard.press("Control+End")
            page.keyboard.type("\nquick = True")
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
            prompts = page.locator(f"{panel} .jp-CodeCell .jp-InputArea-prompt")
            code_cells = prompts.count()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                texts = prompts.all_inner_texts()
                if sum(bool(re.fullmatch(r"\[\d+\]:", text.strip())) for text in texts) == code_cells:
                    break
                time.sleep(1)
            else:
                pytest.fail(f"Run All did not finish in 300 s: prompts {texts}")
            drawn = page.locator(f"{panel} .js-plotly-plot:has(.main-svg)").count()
            page.keyboard.press("Control+s")
            page.wait_for_function("() => !document.querySelector('.jp-mod-current.jp-mod-dirty')", timeout=30_000)
            browser.close()
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)

    ran = nbformat.read(tmp_path / "lab" / f"{NOTEBOOK}.ipynb", as_version=4)
    outputs = [output for cell in ran.cells if cell.cell_type == "code" for output in cell.outputs]
    errors = [f"{output.ename}: {output.evalue}" for output in outputs if output.output_type == "error"]
    assert not errors, errors
    figures = sum(PLOTLY_MIME in output.get("data", {}) for output in outputs)
    assert figures >= 3 and drawn == figures, (figures, drawn)  # every figure output drawn as plotly SVG
    assert shipped.read_bytes() == before  # the shipped notebook: no outputs, no edit, no autosave
    runs = list_runs(tmp_path / "results")
    assert list(runs["state"]) == ["finished"] and list(runs["failed"]) == [0]
    run = Path(runs["path"][0])
    info = json.loads((run / "run.json").read_text())
    assert info["notebooks"][NOTEBOOK]["status"] == "ok"
    assert info["notebooks"][NOTEBOOK]["parameters"]["D"] == get(NOTEBOOK).quick["D"]  # quick = True took effect
    assert (run / "report.html").is_file()
