"""Shared test set-up: no test writes into the project's own results/."""

import pytest

pytest_plugins = ["pytester"]  # test_pytest_plugin runs users' test suites in temporary projects


@pytest.fixture(autouse=True)
def results_root(tmp_path_factory, monkeypatch):
    """Point BENCHLIB_RESULTS (the default results root, inherited by notebook kernels) at a temp dir."""
    root = tmp_path_factory.mktemp("results")
    monkeypatch.setenv("BENCHLIB_RESULTS", str(root))
    return root
