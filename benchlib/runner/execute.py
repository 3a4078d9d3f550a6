"""Batch runs: validate everything, then execute notebooks through papermill into one run directory.

Each notebook gets `device` (resolved) and `results_dir` (the run directory) injected, writes its
records and figures through `benchlib.results.Run.open(results_dir)`, and is executed into
`<run>/notebooks/<name>.ipynb`. A failing notebook is recorded with its error and the rest run;
run.json is rewritten (atomically) before and after every notebook, so Ctrl-C loses nothing
already written.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from benchlib.results import Run, default_results_root, load_records
from benchlib.results.seed_verdicts import verdict_text
from benchlib.results.store import now_iso
from benchlib.runner.notebooks import (
    INJECTED,
    NotebookSpec,
    RunnerError,
    check_value,
    coerce_text,
    find_project_notebooks,
    inspect,
    select_notebooks,
)

KERNEL_NAME = "python3"
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class NotebookResult:
    """How one notebook went: status is 'ok', 'failed', 'interrupted' or 'not run'."""

    name: str
    status: str
    duration_s: float
    parameters: dict[str, Any]
    error: str | None = None
    output: Path | None = None


@dataclass
class RunResult:
    """The outcome of `run`: where the results are and each notebook's result, in order."""

    run_id: str
    path: Path
    notebooks: list[NotebookResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(result.status == "ok" for result in self.notebooks)

    @property
    def exit_code(self) -> int:
        """0 when every notebook ran cleanly, 130 when interrupted, else 1."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        return 0 if self.ok else 1

    def summary(self) -> str:
        """The table printed at the end: notebook, status, duration (and the error of a failed one)."""
        width = max([len("notebook")] + [len(result.name) for result in self.notebooks])
        lines = [f"{'notebook':<{width}}  {'status':<11}  {'duration':>9}"]
        for result in self.notebooks:
            line = f"{result.name:<{width}}  {result.status:<11}  {result.duration_s:>7.1f} s"
            if result.error:
                line += f"  {result.error.splitlines()[0][:120]}"
            lines.append(line)
        lines.append(f"results: {self.path}")
        return "\n".join(lines)


def _check_out_dir(root: Path) -> None:
    """Refuse an output root that cannot be created or written, before anything runs."""
    existing = root
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunnerError(f"--out {str(root)!r} cannot be created: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunnerError(f"--out {str(root)!r} is not writable ({str(existing)!r} refuses writes); choose a directory you can write")


def _check_kernel() -> None:
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


def _resolve_device(device: str) -> Any:
    from benchlib.measure import DeviceError, resolve_device

    try:
        return resolve_device(device)
    except DeviceError as error:
        raise RunnerError(f"--device {device!r}: {error}") from error


def _allocator_policy() -> str | None:
    from benchlib.measure import DEFAULT_MALLOC_POLICY

    return DEFAULT_MALLOC_POLICY


def plan(
    notebooks: Sequence[str],
    *,
    params: Mapping[str, Any],
    quick: bool,
    notebooks_dir: Path,
) -> list[tuple[NotebookSpec, dict[str, Any]]]:
    """Each selected notebook with the parameters it will get (QUICK, then `params`), all checked.

    A name in `params` goes to every selected notebook that declares it and must be declared by
    at least one; a str value is read as on the command line (a literal where it parses as one).
    """
    specs = [inspect(name, path) for name, path in select_notebooks(notebooks, notebooks_dir).items()]
    for name in params:
        if name in INJECTED:
            raise RunnerError(f"{name} is set by the runner: use --device for device and --out for results_dir")
        if not any(name in spec.parameters for spec in specs):
            listing = "\n".join(f"{spec.name}:\n{spec.describe_parameters()}" for spec in specs)
            raise RunnerError(f"unknown parameter {name!r}; the selected notebooks take:\n{listing}")
    planned = []
    for spec in specs:
        values: dict[str, Any] = {}
        if quick:
            if spec.quick is None:
                raise RunnerError(f"--quick: {spec.path.name} has no cell tagged 'quick' holding QUICK = {{...}}")
            values.update({key: check_value(spec, key, value) for key, value in spec.quick.items()})
        for name, value in params.items():
            if name in spec.parameters:
                values[name] = coerce_text(spec, name, value) if isinstance(value, str) else check_value(spec, name, value)
        planned.append((spec, values))
    return planned


def _error_text(error: BaseException) -> str:
    """papermill's execution error as 'ename: evalue' (the notebook's own exception); others by type."""
    ename = getattr(error, "ename", None)
    if ename:
        return f"{ename}: {getattr(error, 'evalue', '')}"
    return f"{type(error).__name__}: {error}"


def run(
    notebooks: Sequence[str] = (),
    *,
    device: str = "auto",
    params: Mapping[str, Any] | None = None,
    out: str | os.PathLike | None = None,
    quick: bool = False,
    notebooks_dir: str | os.PathLike | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    command: Sequence[str] | None = None,
) -> RunResult:
    """Run `notebooks` (names, default all) into a new run directory under `out` (default results/).

    Everything is validated first (RunnerError / DeviceError, both ValueErrors); then each
    notebook runs in turn. Failures are recorded, not raised. On KeyboardInterrupt the run is
    recorded as interrupted, the summary printed, and the interrupt re-raised.
    """
    stream = stream or sys.stdout
    notebooks_dir = Path(notebooks_dir) if notebooks_dir is not None else find_project_notebooks()
    root = Path(out) if out is not None else default_results_root()
    planned = plan(notebooks, params=dict(params or {}), quick=quick, notebooks_dir=notebooks_dir)
    resolved = _resolve_device(device)
    _check_out_dir(root)
    _check_kernel()

    import papermill

    results_run = Run.create(
        root,
        resolved,
        allocator_policy=_allocator_policy(),
        device_requested=device,
        quick=quick,
        params={name: value for name, value in (params or {}).items()},
        notebooks_dir=str(notebooks_dir.resolve()),
        command=list(command) if command is not None else None,
    )
    result = RunResult(results_run.run_id, results_run.path)
    injected = {"device": resolved.name, "results_dir": str(results_run.path.resolve())}
    for spec, values in planned:
        results_run.info["notebooks"][spec.name] = {"status": "not run", "parameters": {**values, **injected}}
    results_run.write_info()
    print(f"run {results_run.run_id}: {len(planned)} notebook(s) on {resolved.name} -> {results_run.path}", file=stream, flush=True)

    for index, (spec, values) in enumerate(planned, start=1):
        parameters = {**values, **injected}
        output = results_run.path / "notebooks" / f"{spec.name}.ipynb"
        output.parent.mkdir(exist_ok=True)
        shown = ", ".join(f"{key}={value!r}" for key, value in values.items())
        print(f"[{index}/{len(planned)}] {spec.name}: started{f' ({shown})' if shown else ''}", file=stream, flush=True)
        results_run.record_notebook(spec.name, status="running", started_at=now_iso())
        started = time.perf_counter()
        status, error = "ok", None
        try:
            papermill.execute_notebook(
                str(spec.path),
                str(output),
                parameters=parameters,
                kernel_name=KERNEL_NAME,
                progress_bar=progress,
                cwd=str(spec.path.parent),
            )
        except KeyboardInterrupt:
            duration = time.perf_counter() - started
            results_run.record_notebook(
                spec.name, status="interrupted", duration_s=round(duration, 3), ended_at=now_iso(), error="KeyboardInterrupt"
            )
            result.notebooks.append(NotebookResult(spec.name, "interrupted", duration, parameters, "KeyboardInterrupt", output))
            result.notebooks.extend(NotebookResult(s.name, "not run", 0.0, {**v, **injected}) for s, v in planned[index:])
            result.interrupted = True
            results_run.finish(interrupted=True)
            print(f"[{index}/{len(planned)}] {spec.name}: interrupted", file=stream, flush=True)
            print(result.summary(), file=stream, flush=True)
            raise
        except Exception as failure:  # a notebook's failure is a result to record; the others still run
            status, error = "failed", _error_text(failure)
        duration = time.perf_counter() - started
        results_run.record_notebook(
            spec.name,
            status=status,
            duration_s=round(duration, 3),
            ended_at=now_iso(),
            error=error,
            output=str(output.relative_to(results_run.path)) if output.exists() else None,
        )
        result.notebooks.append(NotebookResult(spec.name, status, duration, parameters, error, output if output.exists() else None))
        print(f"[{index}/{len(planned)}] {spec.name}: {status} in {duration:.1f} s{f' ({error})' if error else ''}", file=stream, flush=True)

    results_run.finish(interrupted=False)
    print(result.summary(), file=stream, flush=True)
    print(verdict_text(load_records(results_run.path)), file=stream, flush=True)
    return result
