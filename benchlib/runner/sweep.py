"""Where a grid's points run (the grid is read in `runner.arguments` and expanded into points in
`runner.preflight`).

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

import io
import json
import tempfile
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchlib.errors import Refused
from benchlib.runner.kernels import ipc_kernel_manager, reap_orphans
from benchlib.runner.arguments import RunnerError
from benchlib.runner.papermill_exec import execute_notebook

BENCHMARK_SLOT = "benchmark"  # the Dask worker resource a timed point needs; one per machine (per GPU)
POINT_SUMMARY = "point.json"  # inside a point's archive: status, error, duration
EXECUTORS = ("local", "dask")


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
                raise Refused(f"a packed point names a file outside its results: {name}")
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
