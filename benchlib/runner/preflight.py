"""Everything `benchlib run` checks before anything runs, and the run plan made of it in one place
(`checked_plan` -> `RunPlan`): the options (`refuse_bad_options`), the benchmarks' values by their declarations
(`values_for`, `check_values`, memory included), the grid, the output root, the Jupyter kernel, the device, PNG
export and the attribution pass's tracker; a grid expanded into its points (`expand` -> `Execution`). Each refusal is a `RunnerError` that says what is valid."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from benchlib.benchmark import INJECTED, ParameterError, unknown_parameters
from benchlib.measure.forkserver import isolation_mode
from benchlib.records.places import OutDirRefused, check_out_dir
from benchlib.report.figure_files import check_static_export
from benchlib.runner.arguments import RunnerError
from benchlib.runner.notebooks import NotebookSpec, select_notebooks
from benchlib.runner.papermill_exec import KERNEL_NAME
from benchlib.runner.sweep import EXECUTORS

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=,-]+")  # what a point's key may hold
ATTRIBUTE = "attribute"  # the parameter of the benchmarks that offer an attribution pass (--attribute sets it)


def check_values(planned: Sequence[tuple[NotebookSpec, dict[str, Any]]], device: Any) -> None:
    """Each benchmark's full parameter set (defaults, then the planned values) by its declaration:
    every value, the rules between them, and the memory the sizes need on `device`."""
    for spec, values in planned:
        try:
            spec.benchmark.config(values, device=device)
        except ParameterError as refused:
            raise RunnerError(str(refused)) from None


def check_kernel() -> None:
    """papermill must run the notebooks with this Python, or the results would describe another environment."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        raise RunnerError(f"no Jupyter kernel {KERNEL_NAME!r}; install ipykernel in this environment ({sys.executable})") from None
    program = spec.argv[0]
    # jupyter_client replaces a bare python/python3/python3.X with sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    if program not in bare and Path(program).resolve() != Path(sys.executable).resolve():
        raise RunnerError(
            f"the {KERNEL_NAME!r} kernel ({spec.resource_dir}) runs {program}, not this Python ({sys.executable}); "
            f"remove that kernelspec or run `{sys.executable} -m ipykernel install --sys-prefix`"
        )


def resolve_run_device(device: str) -> Any:
    from benchlib.measure import DeviceError, resolve_device

    try:
        return resolve_device(device)
    except DeviceError as error:
        raise RunnerError(f"--device {device!r}: {error}") from error


def values_for(
    specs: Sequence[NotebookSpec],
    *,
    params: Mapping[str, Any],
    quick: bool,
) -> list[tuple[NotebookSpec, dict[str, Any]]]:
    """Each selected benchmark (`select_notebooks`, resolved once) with the values it will get beyond its
    defaults (QUICK, then `params`), all checked by its declaration.

    A name in `params` goes to every selected benchmark that declares it and must be declared by
    at least one; a str value is read as on the command line (a literal where it parses as one).
    """
    for name in params:
        if name in INJECTED:
            raise RunnerError(f"{name} is set by the runner: use --device for device and --out for results_dir")
        if not any(name in spec.parameters for spec in specs):
            raise RunnerError(str(unknown_parameters([name], [spec.benchmark for spec in specs])))
    planned = []
    for spec in specs:
        values: dict[str, Any] = {}
        if quick:
            if not spec.has_quick:
                raise RunnerError(f"--quick: {spec.path.name} has no cell tagged 'quick' holding QUICK = {{...}}")
            values.update(spec.benchmark.quick)
        for name, value in params.items():
            if name in spec.parameters:
                values[name] = spec.typed(name, value)
        planned.append((spec, values))
    return planned


def with_attribute(specs: Sequence[NotebookSpec], params: Mapping[str, Any] | None, stream: TextIO) -> dict[str, Any]:
    """`params` with `attribute` on for the selected benchmarks that declare it; refused when none does."""
    offering = [spec.name for spec in specs if ATTRIBUTE in spec.parameters]
    if not offering:
        raise RunnerError(f"--attribute: none of {', '.join(spec.name for spec in specs)} has an attribution pass; "
                          "model files (benchlib run my_model.py --attribute) and identical_closures have one")
    others = [spec.name for spec in specs if ATTRIBUTE not in spec.parameters]
    if others:
        print(f"--attribute: allocation sites for {', '.join(offering)}; {', '.join(others)} run as usual "
              "(no attribution pass)", file=stream, flush=True)
    return {**dict(params or {}), ATTRIBUTE: True}


def check_attribution_available(names: Sequence[str]) -> None:
    """An attribution pass reads memray's records: refused before anything runs where memray is missing."""
    from benchlib.measure.allocations import memray_available

    if not memray_available():
        raise RunnerError(f"--attribute ({', '.join(names)}): allocation sites are captured with memray, which is not "
                          "installed in this environment (Linux and macOS: pip install memray); run without --attribute")


def refuse_bad_options(options, max_timeout_s: float) -> None:
    """RunnerError for `benchlib run`'s options (a `RunOptions`) that cannot go together or are out of range,
    before anything is read."""
    executor = options.executor
    if executor not in EXECUTORS:
        raise RunnerError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if options.scheduler and executor != "dask":
        raise RunnerError("--scheduler goes with --executor dask")
    if options.timeout_s is not None and not (0 < options.timeout_s <= max_timeout_s):
        raise RunnerError(f"--timeout must be a number of seconds > 0, got {options.timeout_s:g} (at most "
                          f"{max_timeout_s:g}, a week; leave it out for no limit)")
    if options.budget_s is not None:
        if not (options.budget_s > 0 and math.isfinite(options.budget_s)):
            raise RunnerError(f"--budget must be a number of minutes > 0, got {options.budget_s / 60:g}")
        if executor != "local":
            raise RunnerError("--budget shares the time among notebooks run one after another: it goes with "
                              "--executor local (on a Dask cluster, bound each point with --timeout)")
    try:
        isolation_mode()  # BENCHLIB_ISOLATION, read by every isolated case: refused here, before any notebook
    except ValueError as error:
        raise RunnerError(str(error)) from None


@dataclass(frozen=True)
class Execution:
    """One papermill execution: a notebook, its checked parameter values, and its grid point (empty without a grid)."""

    spec: NotebookSpec
    values: dict[str, Any]
    point: dict[str, Any] = field(default_factory=dict)
    tag: str = ""  # set by expand() when another point's key reads the same

    @property
    def key(self) -> str:
        """The name in run.json and of its files: the notebook, then `@NAME=VALUE,...` for a grid point
        (and `~tag` where values that differ read alike once made safe for a file name)."""
        if not self.point:
            return self.spec.name
        label = ",".join(f"{name}={_text(value)}" for name, value in self.point.items())
        return f"{self.spec.name}@{_UNSAFE.sub('-', label)}" + (f"~{self.tag}" if self.tag else "")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def expand(planned: Sequence[tuple[NotebookSpec, dict[str, Any]]], grid: Mapping[str, Sequence[Any]],
           params: Mapping[str, Any]) -> list[Execution]:
    """Every notebook at every grid point its parameters cover, each value checked like `-p` (typed by the default)."""
    for name in grid:
        if name in params:
            raise RunnerError(f"{name} is both a -p value and a --grid axis; give it in one place")
        if not any(name in spec.parameters for spec, _ in planned):
            raise RunnerError(f"--grid {name}: no selected notebook has a parameter {name!r}")
    executions = []
    for spec, values in planned:
        axes = [name for name in grid if name in spec.parameters]
        for combination in itertools.product(*(grid[name] for name in axes)):
            point = {}
            for name, value in zip(axes, combination):
                point[name] = spec.typed(name, value)
            executions.append(Execution(spec, {**values, **point}, point))
    return _distinct_keys(executions)


def _distinct_keys(executions: list[Execution]) -> list[Execution]:
    """Points whose keys collide (`a b` and `a/b` both read `a-b`) get a short hash of their exact
    values, so no point's files or run.json entry overwrite another's."""
    counts = Counter(execution.key for execution in executions)
    return [replace(execution, tag=hashlib.sha1(json.dumps(execution.point, sort_keys=True, default=repr).encode())
                    .hexdigest()[:6]) if counts[execution.key] > 1 else execution for execution in executions]


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, every part of it checked: each notebook with its values, the executions (a grid
    point each), the device, the notebooks that attribute allocations, and the values as given typed."""

    planned: list[tuple[NotebookSpec, dict[str, Any]]]
    executions: list
    device: Any
    attributed: list[str]
    typed_params: dict[str, Any]


def checked_plan(notebooks: Sequence[str], options, root: Path, stream) -> RunPlan:
    """The notebooks read (model files checked, once), their values, grid and device checked, the output folder,
    kernel and PNG export too: every refusal before a run directory exists."""
    params = options.params
    notebooks_dir = Path(options.notebooks_dir) if options.notebooks_dir is not None else None
    specs = select_notebooks(notebooks, notebooks_dir)
    if options.attribute:
        params = with_attribute(specs, params, stream)
    planned = values_for(specs, params=dict(params or {}), quick=options.quick)
    attributed = [spec.name for spec, values in planned if values.get(ATTRIBUTE)]
    if attributed:
        check_attribution_available(attributed)
    executions = expand(planned, dict(options.grid or {}), dict(params or {}))
    resolved = resolve_run_device(options.device)
    check_values([(execution.spec, execution.values) for execution in executions], resolved)
    try:
        check_out_dir(root)
    except OutDirRefused as refused:
        raise RunnerError(str(refused)) from None
    check_kernel()
    if options.png:
        try:
            check_static_export()
        except RuntimeError as unavailable:
            raise RunnerError(f"--png: {unavailable}") from None
    typed = {name: next(values[name] for _, values in planned if name in values) for name in (params or {})}
    return RunPlan(planned, executions, resolved, attributed, typed)
