"""Parameter grids and where their points run.

`--grid NAME=V1,V2` (repeatable) makes the cartesian product of the grid with the `-p` values;
each point is one papermill execution with its own results directory (`points/<point>/`) and
executed notebook (`notebooks/<point>.ipynb`), and its records are merged into the run's
`records.parquet` with the point's values in `params["grid"]`.

Points run one at a time on this machine (`--executor local`, as timing requires), or on a Dask
distributed cluster (`--executor dask [--scheduler ADDRESS]`). There every worker advertises one
`benchmark` slot (a worker resource) and every point requires it, so two timed points never
share a machine. A point comes back as bytes of a zip archive of its files (run.json, parquet,
the executed notebook, figures), never as a pickled object, and is unpacked atomically into the
run directory; a point whose worker dies or whose notebook fails is recorded as failed while the
others finish.
"""

from __future__ import annotations

import ast
import hashlib
import io
import itertools
import json
import re
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchlib.runner.kernels import ipc_kernel_manager, reap_orphans
from benchlib.runner.notebooks import NotebookSpec, RunnerError, check_value, coerce_text
from benchlib.runner.papermill_exec import execute_notebook

BENCHMARK_SLOT = "benchmark"  # the Dask worker resource a timed point needs; one per machine (per GPU)
POINT_SUMMARY = "point.json"  # inside a point's archive: status, error, duration
EXECUTORS = ("local", "dask")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=,-]+")


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


def parse_grid(assignments: Sequence[str]) -> dict[str, list[Any]]:
    """`NAME=V1,V2,...` texts as {name: [values]}: the values as one Python list literal where they
    parse as one (`D=100,200`, `engines=['a'],['b']`), else comma-separated text (`dtype=float32,float64`)."""
    grid: dict[str, list[Any]] = {}
    for text in assignments:
        name, equals, values = text.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier() or not values:
            raise RunnerError(f"--grid takes NAME=V1,V2,... (e.g. --grid D=100,200 or --grid dtype=float32,float64), got {text!r}")
        if name in grid:
            raise RunnerError(f"--grid {name} is given twice; list all its values in one --grid")
        try:
            parsed = ast.literal_eval(f"[{values}]")
        except (ValueError, SyntaxError):
            parsed = None
        grid[name] = parsed if isinstance(parsed, list) and parsed else values.split(",")
        if len(set(map(repr, grid[name]))) != len(grid[name]):
            raise RunnerError(f"--grid {name} repeats a value: {values}")
    return grid


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
                point[name] = coerce_text(spec, name, value) if isinstance(value, str) else check_value(spec, name, value)
            executions.append(Execution(spec, {**values, **point}, point))
    return _distinct_keys(executions)


def _distinct_keys(executions: list[Execution]) -> list[Execution]:
    """Points whose keys collide (`a b` and `a/b` both read `a-b`) get a short hash of their exact
    values, so no point's files or run.json entry overwrite another's."""
    counts = Counter(execution.key for execution in executions)
    return [replace(execution, tag=hashlib.sha1(json.dumps(execution.point, sort_keys=True, default=repr).encode())
                    .hexdigest()[:6]) if counts[execution.key] > 1 else execution for execution in executions]


# ---------------------------------------------------------------- one point, anywhere


def pack_point(results_dir: Path, executed: Path, summary: Mapping[str, Any]) -> bytes:
    """A point's outcome as the bytes of a zip: POINT_SUMMARY, the executed notebook, and every file of its results."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(POINT_SUMMARY, json.dumps(dict(summary)))
        if executed.is_file():
            archive.write(executed, "executed.ipynb")
        for path in sorted(results_dir.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                archive.write(path, f"results/{path.relative_to(results_dir)}")
    return buffer.getvalue()


def unpack_point(data: bytes, results_dir: Path, executed: Path) -> dict[str, Any]:
    """Write a packed point into the run (each file atomically); return its summary."""
    from benchlib.records.store import write_atomic

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        summary = json.loads(archive.read(POINT_SUMMARY))
        for name in archive.namelist():
            if name == POINT_SUMMARY:
                continue
            target = executed if name == "executed.ipynb" else results_dir / name.removeprefix("results/")
            if not target.resolve().is_relative_to(results_dir.resolve()) and target != executed:
                raise ValueError(f"a packed point names a file outside its results: {name}")
            content = archive.read(name)
            write_atomic(target, lambda temp, content=content: Path(temp).write_bytes(content))
    return summary


def execute_remote(notebook_text: str, notebook_name: str, parameters: dict[str, Any], cwd: str,
                   figures_env: dict[str, str], timeout_s: float | None = None) -> bytes:
    """Run one point on a Dask worker: the notebook from its text, into a private temporary run
    directory; return the packed point (bytes of a zip). Runs in the worker's process."""
    with tempfile.TemporaryDirectory(prefix="benchlib-point-") as tmp:
        tmp_path = Path(tmp)
        source, executed, results_dir = tmp_path / f"{notebook_name}.ipynb", tmp_path / "executed.ipynb", tmp_path / "run"
        source.write_text(notebook_text, encoding="utf-8")
        results_dir.mkdir()
        working = cwd if Path(cwd).is_dir() else tmp
        started = time.perf_counter()
        # the point's failure travels back as data
        status, error = execute_notebook(source, executed, {**parameters, "results_dir": str(results_dir)}, cwd=working,
                                         kernel=ipc_kernel_manager(tmp), kernel_env=figures_env,
                                         timeout_s=timeout_s)
        reap_orphans()
        summary = {"status": status, "error": error, "duration_s": round(time.perf_counter() - started, 3)}
        return pack_point(results_dir, executed, summary)


def dask_client(scheduler: str | None):
    """A Dask client: to `scheduler`, or to a local cluster of one worker holding one benchmark slot
    (so points on this machine still run one at a time). Refused with what to install when dask is missing."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise RunnerError("--executor dask needs Dask distributed: pip install -e '.[dask]'") from None
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except OSError as error:
            raise RunnerError(f"--scheduler {scheduler!r}: cannot connect ({error})") from None
        slots = sum(worker.get("resources", {}).get(BENCHMARK_SLOT, 0)
                    for worker in client.scheduler_info()["workers"].values())
        if not slots:
            client.close()
            raise RunnerError(f"--scheduler {scheduler!r}: no worker offers a {BENCHMARK_SLOT!r} slot; start workers with "
                              f"dask worker {scheduler} --nthreads 1 --resources {BENCHMARK_SLOT}=1")
        return client, None
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={BENCHMARK_SLOT: 1},
                           dashboard_address=None)
    return Client(cluster), cluster
