"""benchlib's pytest plugin: memory gates on a model file's gradient step in a user's own test suite.

Installed with benchlib (entry point `pytest11`), it adds the `gradient_step` fixture and the
`limit_gradient_step` marker:

    @pytest.mark.limit_gradient_step(peak="64 MiB", allocations=20_000, growth="1.1x")
    @pytest.mark.parametrize("engine", ["torch", "torch.func"])
    def test_step_stays_lean(gradient_step, engine):
        gradient_step("model.py", engine, params={"hidden": 256})

Each call measures one step in a fresh process (`benchlib.usermodel.gate.measure_step`) and fails the
test when the step misses a limit, saying by how much, which role grew and the line holding the peak.
`growth` compares with a baseline recorded by `pytest --benchlib-save-baselines` (one JSON file per
test, in `.benchlib-baselines/` beside the rootdir's config unless `--benchlib-baselines DIR`).
Limits that do not parse are a usage error at collection, before anything is measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

MARKER = "limit_gradient_step"
DEFAULT_BASELINES = ".benchlib-baselines"
_STEPS = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("benchlib", "memory gates on gradient steps (benchlib)")
    group.addoption("--benchlib-baselines", metavar="DIR", default=None,
                    help=f"where the gradient_step baselines live (default: {DEFAULT_BASELINES}/ in the rootdir)")
    group.addoption("--benchlib-save-baselines", action="store_true", default=False,
                    help="record every measured gradient step as its test's baseline (growth limits are not "
                         "checked on this run; absolute limits still are)")
    group.addoption("--benchlib-device", metavar="DEVICE", default="cpu",
                    help="where gradient_step measures: cpu, cuda, cuda:N or auto (default: cpu)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(peak=None, allocations=None, python_allocations=None, growth=None): limits on every "
                   "gradient step the test measures with the gradient_step fixture (peak: bytes or '64 MiB'; "
                   "allocations: a count; growth: a ratio over the stored baseline, '1.1x')")
    config.stash[_STEPS] = []
    device = config.getoption("--benchlib-device")
    if device != "cpu":  # a device that is not here stops the session before any test, not in each
        from benchlib.measure import DeviceError, resolve_device

        try:
            resolve_device(device)
        except DeviceError as error:
            raise pytest.UsageError(f"--benchlib-device {device}: {error}") from None


def _marker_limits(item: pytest.Item):
    from benchlib.usermodel.gate import Limits

    limits = Limits()
    for marker in reversed(list(item.iter_markers(MARKER))):  # the closest marker wins
        if marker.args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} takes keywords only (peak=, allocations=, "
                                    f"python_allocations=, growth=), got positional {marker.args!r}")
        limits = limits.merged(Limits.parse(**marker.kwargs))
    return limits


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every marker's limits are parsed before any test runs: one that does not parse stops the session. A
    session without the marker imports nothing of benchlib (the gate's modules import torch: a second of every
    pytest run where the plugin is installed)."""
    marked = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if not marked:
        return
    from benchlib.errors import Refused

    for item in marked:
        try:
            _marker_limits(item)
        except (Refused, TypeError) as error:  # a limit that does not parse (the gate's and units' refusals)
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER}: {error}") from None
        if "gradient_step" not in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} limits the steps the gradient_step fixture "
                                    "measures, and this test does not use it: nothing would be checked")


class GradientStep:
    """The `gradient_step` fixture's value: call it to measure and check one step (see the module)."""

    def __init__(self, request: pytest.FixtureRequest):
        from benchlib.usermodel.gate import Baselines

        config = request.config
        root = Path(config.rootpath)
        folder = config.getoption("--benchlib-baselines")
        self._request = request
        self._baselines = Baselines(Path(folder) if folder else root / DEFAULT_BASELINES)
        self._save = config.getoption("--benchlib-save-baselines")
        self._device = config.getoption("--benchlib-device")
        self._limits = _marker_limits(request.node)
        self.calls = 0  # steps measured: a marked test that measured none checked nothing

    def _model_path(self, model: str | Path | Mapping[str, Any]) -> Path:
        """A path (relative: to the test file's folder, else to the current one), or a mapping of the torch
        form's functions written to a file."""
        from benchlib.usermodel.template import write_model_file

        if isinstance(model, Mapping):
            return write_model_file(model, self._request.getfixturevalue("tmp_path"))
        path = Path(model)
        if path.is_absolute():
            return path
        beside_test = Path(self._request.path).parent / path
        return beside_test if beside_test.exists() or not path.exists() else path.resolve()

    def __call__(self, model: str | Path | Mapping[str, Any], engine: str = "torch", *, params: dict | None = None,
                 quick: bool = False, peak: Any = None, allocations: Any = None, python_allocations: Any = None,
                 growth: Any = None):
        """Measure `engine`'s step of `model` and hold it to the marker's limits, overridden by these."""
        from benchlib.benchmark import ParameterError
        from benchlib.usermodel.gate import GateError, Limits, check_step, measure_step
        from benchlib.usermodel.loader import ModelFileError

        test_id = self._request.node.nodeid
        self.calls += 1
        try:
            limits = self._limits.merged(Limits.parse(peak, allocations, python_allocations, growth))
            cost = measure_step(self._model_path(model), engine, params=params, quick=quick, device=self._device)
            if self._save:
                self._baselines.save(test_id, cost)
                limits = Limits(limits.peak, limits.allocations, limits.python_allocations)
            baseline = None if limits.growth is None else self._baselines.get(test_id, cost)
            problems = check_step(cost, limits, baseline, str(self._baselines.file(test_id)))
        except (GateError, ModelFileError, ParameterError) as error:
            pytest.fail(f"gradient_step: {error}", pytrace=False)
        self._request.config.stash[_STEPS].append((test_id, cost, bool(problems)))
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)
        return cost


@pytest.fixture
def gradient_step(request: pytest.FixtureRequest):
    """Measure a model file's gradient step under one engine in a fresh process, and check it against
    the test's `limit_gradient_step` marker and the stored baseline. A marked test that measured no step
    errors at teardown: its limits checked nothing."""
    step = GradientStep(request)
    yield step
    if step.calls == 0 and request.node.get_closest_marker(MARKER) is not None:
        pytest.fail(f"@pytest.mark.{MARKER} limits this test's gradient steps, but it never called "
                    "gradient_step(...): nothing was checked", pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    steps = config.stash.get(_STEPS, [])
    if not steps:
        return
    terminalreporter.section("benchlib gradient steps")
    for test_id, cost, failed in steps:
        terminalreporter.write_line(f"{'FAILED ' if failed else ''}{test_id}: {cost}")
    if config.getoption("--benchlib-save-baselines"):
        terminalreporter.write_line(f"baselines saved under {config.getoption('--benchlib-baselines') or DEFAULT_BASELINES}")
