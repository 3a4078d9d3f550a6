"""Shared test set-up: no test writes into the project's own results/; the declared benchmarks are registered."""

import pytest

pytest_plugins = ["pytester"]  # test_pytest_plugin runs users' test suites in temporary projects


@pytest.fixture(autouse=True, scope="session")
def declared_benchmarks():
    """Every declared benchmark registered, as the runner's discovery registers them: tests call a workload's own
    functions, which make its benchmark's records, without the Config a kernel makes first (and registers by)."""
    from benchlib import registry

    return registry.benchmarks()


@pytest.fixture(autouse=True)
def results_root(tmp_path_factory, monkeypatch):
    """Point BENCHLIB_RESULTS (the default results root, inherited by notebook kernels) at a temp dir."""
    root = tmp_path_factory.mktemp("results")
    monkeypatch.setenv("BENCHLIB_RESULTS", str(root))
    return root


class CountingBackend:
    """A torch.compile backend that runs the traced graphs as they are and counts how many it was handed."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward


@pytest.fixture
def counting_backend(monkeypatch):
    """Every torch.compile benchlib makes (the registry's engine, a model file's) uses a `CountingBackend`."""
    import torch._dynamo

    from benchlib.engines import compiling

    torch._dynamo.reset()
    backend = CountingBackend()
    monkeypatch.setattr(compiling, "COMPILE_BACKEND", backend)
    yield backend
    torch._dynamo.reset()
