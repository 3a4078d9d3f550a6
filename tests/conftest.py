"""Shared test set-up: no test writes into the project's own results/; the declared benchmarks are registered; a
test that starts a process is marked `slow` (`make check` runs the others, in seconds)."""

import os
import subprocess

import _posixsubprocess
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


@pytest.fixture
def fit_children_here(monkeypatch):
    """fit's calls of a model file's code (its reading and form check, the engine facts, traces, blocks) made in this
    process through the doors its children pass (`reading.read_in_child`, `in_child.call_in_child`), with the same
    JSON values: for tests of fit's search whose measured steps are faked, so that they start no process."""
    import json

    from benchlib.fit import in_child
    from benchlib.measure import resolve_device
    from benchlib.usermodel import reading

    def call_here(function, model_file, what, timeout_s=None, **params):
        made = getattr(in_child, function)(device=resolve_device("cpu"), path=str(model_file.path), **params)
        return json.loads(json.dumps(made, allow_nan=False))

    monkeypatch.setattr(reading, "read_in_child", lambda groups, shapes_only=False: reading.answers(
        [reading.read_outcome(list(map(str, group)), shapes_only) for group in groups]))
    monkeypatch.setattr(in_child, "call_in_child", call_here)
    monkeypatch.setattr(in_child, "trace_workers", lambda engines: 1)  # one engine after another, through that door


class ProcessGuard:
    """Records every process a test not marked `slow` starts, from its set-up to its end: `subprocess` (a kernel's, a
    browser's and the fork template's launchers among its callers) and multiprocessing reach `fork_exec`, the rest
    `os.fork`, `posix_spawn` or `system`. The process still starts (the test runs as written), and the test then
    fails, naming what it started."""

    WATCHED = ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"), (os, "posix_spawn"),
               (os, "posix_spawnp"), (os, "system"))

    def __init__(self):
        self.started: list[str] = []
        self._real = {}

    def __enter__(self):
        for owner, name in self.WATCHED:
            real = self._real[(owner, name)] = getattr(owner, name)
            setattr(owner, name, self._recording(name, real))
        return self

    def __exit__(self, *_exc):
        for (owner, name), real in self._real.items():
            setattr(owner, name, real)

    def _recording(self, name, real):
        def started(*args, **kwargs):
            self.started.append(f"{name.lstrip('_')}: {_command(name, args)}")
            return real(*args, **kwargs)
        return started


def _command(name: str, args: tuple) -> str:
    """The command a launcher was given, as far as its arguments say (fork has none)."""
    if name.endswith("fork_exec") and args and isinstance(args[0], (list, tuple)):
        return " ".join(os.fsdecode(part) for part in args[0])[:200]
    if name in ("posix_spawn", "posix_spawnp") and len(args) > 1:
        return " ".join(map(str, args[1]))[:200]
    return str(args[0])[:200] if args else "(a copy of this process)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") is None:
        item._process_guard = ProcessGuard().__enter__()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A passing test not marked `slow` that started a process (in its set-up or its body) fails, saying so."""
    outcome = yield
    guard = getattr(item, "_process_guard", None)
    if guard is None:
        return
    report = outcome.get_result()
    if call.when == "call" and guard.started and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {len(guard.started)} process(es) but is not marked slow: mark it "
                           f"@pytest.mark.slow (`make check` runs only the tests that start none).\n  "
                           + "\n  ".join(guard.started[:5]))
    elif call.when == "teardown":
        guard.__exit__(None, None, None)
        del item._process_guard


def _expected_cost(item) -> float:
    """A test's rough cost for ordering: minutes-long tests (a timeout past the default), then the `slow` ones."""
    timeout = item.get_closest_marker("timeout")
    if timeout is not None and timeout.args and timeout.args[0] > float(item.config.getini("timeout")):
        return 15.0  # about fifteen typical slow tests
    return 1.0 if item.get_closest_marker("slow") is not None else 0.02


def pytest_collection_modifyitems(config, items):
    """The costliest files first, each kept whole (its module fixtures are made once): on xdist the long tests
    start early and spread over the workers, and the last ones to run are short, so no worker idles beside one
    long test at the end."""
    cost: dict[str, float] = {}
    for item in items:
        cost[item.module.__name__] = cost.get(item.module.__name__, 0.0) + _expected_cost(item)
    first_seen = {name: index for index, name in enumerate(dict.fromkeys(item.module.__name__ for item in items))}
    items.sort(key=lambda item: (-cost[item.module.__name__], first_seen[item.module.__name__]))
