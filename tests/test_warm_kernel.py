"""The first notebook's kernel, started while the runner checks a model file (`WarmKernel`): taken once by a
notebook with its folder and environment, shut down otherwise, never left behind."""

import sys
import textwrap

import psutil
import pytest
from jupyter_client import BlockingKernelClient

from benchlib.records.store import UNDER_RUNNER_ENV
from benchlib.runner import execute
from benchlib.runner.cli import main
from benchlib.runner.papermill_exec import WarmKernel, shut_down
from benchlib.runner.startup import IRI_GRAMMARS, skip_iri_grammars
from test_usermodel import GOOD


def kernels_alive() -> list:
    return [child for child in psutil.Process().children(recursive=True)
            if "ipykernel" in " ".join(child.cmdline())]


def evaluate(kernel, expression: str) -> str:
    client = BlockingKernelClient()
    client.load_connection_info(kernel.get_connection_info())
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive(f"print({expression})", timeout=60, output_hook=lambda message: printed.append(
            message["content"].get("text", "")) if message["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
    return "".join(printed).strip()


printed: list[str] = []


@pytest.mark.slow
def test_a_notebook_in_its_folder_and_environment_takes_it_once_with_its_imports_made(tmp_path):
    printed.clear()
    with WarmKernel(tmp_path, {"WARM_TEST": "yes"}, imports=("answer = 41 + 1",)) as warm:
        kernel = warm.take(tmp_path, {"WARM_TEST": "yes"})
        assert kernel is not None and warm.take(tmp_path, {"WARM_TEST": "yes"}) is None
        try:
            seen = evaluate(kernel, f"answer, __import__('os').getcwd(), __import__('os').environ['WARM_TEST'], "
                                    f"__import__('os').environ['{UNDER_RUNNER_ENV}'], "
                                    f"__import__('sys').modules.get('{IRI_GRAMMARS}', 'imported')")
        finally:
            shut_down(kernel)
    assert seen == f"42 {tmp_path.resolve()} yes 1 None"  # it started as benchlib's processes do (runner.startup)
    assert not kernels_alive()


@pytest.mark.slow
@pytest.mark.parametrize("other", ["folder", "environment", "nobody"])
def test_a_kernel_no_notebook_fits_is_shut_down(tmp_path, other):
    with WarmKernel(tmp_path, {"WARM_TEST": "yes"}) as warm:
        assert len(kernels_alive()) == 1
        if other == "folder":
            assert warm.take(tmp_path / "elsewhere", {"WARM_TEST": "yes"}) is None
        elif other == "environment":
            assert warm.take(tmp_path, {"WARM_TEST": "no"}) is None
    assert not kernels_alive()


@pytest.mark.slow
def test_a_model_file_run_uses_it_and_a_refused_one_leaves_no_kernel(tmp_path, monkeypatch):
    taken = []

    class Spy(WarmKernel):
        def take(self, cwd, kernel_env):
            taken.append(super().take(cwd, kernel_env))
            return taken[-1]

    monkeypatch.setattr(execute, "WarmKernel", Spy)
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(GOOD))
    assert main(["run", str(model), "--quick", "-p", "engines=torch", "-p", "trials=1", "--device", "cpu",
                 "--out", str(tmp_path / "out")]) == 0
    assert len(taken) == 1 and taken[0] is not None
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n")
    assert main(["run", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert len(taken) == 1 and not kernels_alive()


def test_a_process_that_skips_the_iri_grammars_still_validates_a_notebook():
    """What benchlib's processes skip (runner.startup) is only jsonschema's optional IRI checker: nbformat's
    validation, which papermill and plotly's renderer rely on, is unchanged."""
    import importlib

    import nbformat

    saved = sys.modules.pop(IRI_GRAMMARS, None)
    try:
        skip_iri_grammars()
        with pytest.raises(ImportError):
            importlib.import_module(IRI_GRAMMARS)
        nbformat.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]))
        with pytest.raises(nbformat.ValidationError):
            nbformat.validate({"nbformat": 4, "nbformat_minor": 5, "cells": [], "metadata": {"kernelspec": 3}})
    finally:
        sys.modules.pop(IRI_GRAMMARS, None)
        if saved is not None:
            sys.modules[IRI_GRAMMARS] = saved
