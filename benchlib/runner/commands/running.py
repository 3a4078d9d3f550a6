"""`benchlib run`, `list` and `notebooks`: run benchmarks (declared ones, notebooks, model files) into a run
directory, list them with their parameters, copy the built-in notebooks out for JupyterLab."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from benchlib.runner.arguments import RunnerError, parse_assignments, ranks_params


def add_commands(commands, common: Sequence[argparse.ArgumentParser]) -> None:
    run_parser = commands.add_parser(
        "run", parents=common,
        help="execute notebooks into a new run directory",
        description=(
            "Execute benchmarks (all declared ones when none is named, the yardstick (calibration) first), each in a fresh "
            "kernel, with device and results_dir injected. Every name and value is checked by the benchmark's "
            "declaration before anything runs. Exit status: 0 all ok, 1 a notebook failed, partly failed or timed "
            "out, 2 refused or a file could not be written, 130 interrupted (Ctrl-C, SIGTERM, SIGHUP)."
        ),
    )
    run_parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                            help="benchmark names (benchlib list shows them), paths to .ipynb files, or model files "
                                 "(.py, see `benchlib new`)")
    run_parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N (default: auto)")
    run_parser.add_argument(
        "-p", "--param", action="append", default=[], metavar="NAME=VALUE",
        help="set a parameter; VALUE is a Python literal (3, 1e-3, True, \"[1, 2]\") or plain text for str parameters; repeatable",
    )
    run_parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="stop a notebook (a grid point) that runs longer: it is recorded as `timed out` (a failure), its records "
             "so far are kept and the others still run (default: no limit)")
    run_parser.add_argument(
        "--budget", type=float, default=None, metavar="MINUTES",
        help="end the run in about this many minutes: the notebooks share the time by their last durations, each "
             "case's trials stop when the next would not fit (recorded as stop=budget), and what could not be "
             "afforded is listed as `not run` (default: no budget; trials stop at their precision or their cap)")
    run_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="root for the run directory (default: results/)")
    run_parser.add_argument("--quick", action="store_true", help="use each notebook's QUICK sizes (its cell tagged 'quick'); -p wins")
    run_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR", help="where notebooks live (default: notebooks/)")
    run_parser.add_argument("--no-progress", action="store_true",
                            help="hide the notebooks' own output lines (only each notebook's start and end are printed)")
    run_parser.add_argument(
        "--grid", action="append", default=[], metavar="NAME=V1,V2,...",
        help="sweep a parameter: the cartesian product of every --grid with the -p values, one execution per point "
             "(values typed as for -p; repeatable)")
    run_parser.add_argument("--executor", default="local", choices=("local", "dask"),
                            help="where grid points run: local (one at a time, the default) or dask")
    run_parser.add_argument("--scheduler", default=None, metavar="ADDRESS",
                            help="with --executor dask: the scheduler (default: a local cluster of one benchmark slot)")
    run_parser.add_argument(
        "--attribute", action="store_true",
        help="one more traced pass per case, recorded apart from the measured ones: the source lines holding the "
             "peak, the temporaries, and site-by-site diffs, in the records and report.html (model files and "
             "identical_closures; needs memray)")
    run_parser.add_argument(
        "--ranks", type=int, default=None, metavar="N",
        help="a model file's step on N torch.distributed ranks, a process each (gloo on the CPU, NCCL on CUDA, a GPU "
             "per rank), under --parallel; records carry rank and world_size (same as -p ranks=N; docs/distributed.md)")
    run_parser.add_argument(
        "--parallel", default=None, metavar="ddp,fsdp",
        help="with --ranks: the parallel strategies to measure each engine under, ddp (a whole copy per rank, "
             "gradients all-reduced) and/or fsdp (FSDP2, sharded per repeated block); eager torch in one process "
             "runs beside them as the baseline (same as -p parallel=fsdp)")
    run_parser.add_argument(
        "--global-batch", default=None, metavar="NAME=B",
        help="with --ranks N: the file's batch parameter NAME at B across all ranks, each rank's B/N (B a multiple "
             "of N); without it, each rank takes the file's batch as given (the global batch is N times it)")
    run_parser.add_argument(
        "--png", action="store_true",
        help="also save every figure as figures/<name>.png and as PNG in the executed notebooks "
             "(needs kaleido, pip install -e '.[png]', and a Chrome/Chromium; refused otherwise)",
    )

    run_parser.set_defaults(handler=_run)

    list_parser = commands.add_parser("list", parents=common, help="the benchmarks: their questions, parameters, defaults, quick values and help")
    list_parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK")
    list_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR")

    list_parser.set_defaults(handler=lambda arguments: _list(arguments.notebooks, arguments.notebooks_dir))

    notebooks_parser = commands.add_parser(
        "notebooks", parents=common, help="copy the built-in notebooks into a folder, to open in JupyterLab",
        description="Copy the built-in notebooks (those `benchlib list` names) into DIR, created if missing; a "
                    "notebook already there is never overwritten (exit 2, nothing copied). Open them with "
                    "`jupyter lab DIR`; their results go to ./results of the folder you run in.")
    notebooks_parser.add_argument("folder", type=Path, metavar="DIR", help="where to copy them")
    notebooks_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR",
                                  help="where the notebooks are (default: the project's notebooks/, else the "
                                       "installed copy's)")
    notebooks_parser.set_defaults(handler=lambda arguments: _copy_notebooks(arguments.folder, arguments.notebooks_dir))

    lab_parser = commands.add_parser(
        "lab", parents=common, help="JupyterLab on working copies of the notebooks: the shipped ones stay clean",
        description="Copy each built-in notebook missing from DIR into it, then start JupyterLab there. Outputs, "
                    "edits and autosaves land in the copies, never in the notebooks benchlib ships or this project "
                    "tracks; a copy already in DIR is kept (one whose cells differ from the built-in notebook's is "
                    "named: delete it for the current one). Runs started there go to the results root ("
                    "$BENCHLIB_RESULTS, else results/ of the project, else ./results), linked into DIR as results/. "
                    "Arguments after -- go to jupyter lab (e.g. benchlib lab -- --port 8890 --no-browser).")
    lab_parser.add_argument("--dir", type=Path, default=Path("lab"), metavar="DIR", dest="folder",
                            help="the working copies' folder (default: ./lab)")
    lab_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR",
                            help="where the notebooks are (default: the project's notebooks/, else the installed copy's)")
    lab_parser.add_argument("jupyter_args", nargs="*", metavar="JUPYTER_ARG", help=argparse.SUPPRESS)
    lab_parser.set_defaults(handler=lambda arguments: _lab(arguments.folder, arguments.notebooks_dir, arguments.jupyter_args))


def _run(arguments: argparse.Namespace) -> int:
    from benchlib.runner.execute import run
    from benchlib.runner.arguments import parse_grid

    result = run(
        arguments.notebooks,
        device=arguments.device,
        params=ranks_params(arguments, parse_assignments(arguments.param)),
        out=arguments.out,
        quick=arguments.quick,
        notebooks_dir=arguments.notebooks_dir,
        progress=not arguments.no_progress,
        png=arguments.png,
        grid=parse_grid(arguments.grid),
        executor=arguments.executor,
        scheduler=arguments.scheduler,
        attribute=arguments.attribute,
        timeout_s=arguments.timeout,
        budget_s=None if arguments.budget is None else arguments.budget * 60,
        command=["benchlib", *arguments.argv],
    )
    return result.exit_code


def _list(names: Sequence[str], notebooks_dir: Path | None) -> int:
    from benchlib.runner.notebooks import select_notebooks

    for spec in select_notebooks(names, notebooks_dir):
        benchmark = spec.benchmark
        print(f"{benchmark.name}  ({', '.join(map(str, spec.sources)) or spec.path})")
        print(f"  {benchmark.question}")
        if benchmark.cases:
            print(f"  measures: {benchmark.cases}")
        if benchmark.seed is not None:
            print(f"  seed: {benchmark.seed.title}" + (f" <{benchmark.seed.link}>" if benchmark.seed.link else ""))
        print(benchmark.describe_parameters() or "  (no parameters)")
        if not spec.has_quick:
            print("  (no QUICK sizes: --quick will refuse this notebook)")
    return 0


def _copy_notebooks(folder: Path, notebooks_dir: Path | None) -> int:
    from benchlib.runner.notebooks import available_notebooks, find_project_notebooks

    source = notebooks_dir or find_project_notebooks()
    notebooks = available_notebooks(source)
    _check_folder(folder)
    taken = [name for name in notebooks if _occupied(folder / f"{name}.ipynb")]
    if taken:
        raise RunnerError(f"{folder} already holds {', '.join(f'{name}.ipynb' for name in taken)}; benchlib notebooks "
                          "never overwrites a notebook, nor writes through a link (choose an empty folder)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, path in notebooks.items():
            _copy_new(path, folder / f"{name}.ipynb")
    except OSError as error:
        raise RunnerError(f"{folder} cannot be written: {error.strerror}") from None
    print(f"copied {len(notebooks)} notebooks from {source} to {folder}: {', '.join(notebooks)}")
    return 0


def _check_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise RunnerError(f"{folder} is a file; give a folder (new or existing) for the notebooks")


def _occupied(path: Path) -> bool:
    """Whether `path` is taken: a file, or a link (a dangling one too, which `exists()` calls free)."""
    return path.exists() or path.is_symlink()


def _copy_new(source: Path, copy: Path) -> None:
    """`source` copied to `copy`, which must not exist: never over a file, never through a link (O_EXCL)."""
    import shutil

    with open(source, "rb") as read, open(copy, "xb") as write:
        shutil.copyfileobj(read, write)


def working_copies(folder: Path, notebooks_dir: Path | None) -> tuple[list[str], list[str]]:
    """Copy into `folder` each built-in notebook it lacks; returns (copied, kept copies whose cells'
    sources differ from the built-in notebook's). Outputs alone never make a copy differ."""
    import nbformat

    from benchlib.runner.notebooks import available_notebooks, find_project_notebooks

    def sources(path: Path) -> list[str]:
        return [cell.source for cell in nbformat.read(path, as_version=4).cells]

    source = notebooks_dir or find_project_notebooks()
    if folder.resolve() == source.resolve() or source.resolve() in folder.resolve().parents:
        raise RunnerError(f"{folder} is the shipped notebooks' folder{'' if folder.resolve() == source.resolve() else ' or inside it'}; "
                          "give benchlib lab another folder (--dir), where the working copies can change")
    _check_folder(folder)
    copied, edited = [], []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, path in available_notebooks(source).items():
            copy = folder / f"{name}.ipynb"
            if copy.is_symlink() and not copy.exists():
                raise RunnerError(f"{copy} is a link to {os.readlink(copy)}, which does not exist; benchlib never "
                                  "writes through a link (remove it)")
            if not copy.exists():
                _copy_new(path, copy)
                copied.append(name)
            elif sources(copy) != sources(path):
                edited.append(name)
    except OSError as error:
        raise RunnerError(f"{folder} cannot be written: {error.strerror}") from None
    return copied, edited


def _lab(folder: Path, notebooks_dir: Path | None, jupyter_args: Sequence[str]) -> int:
    from benchlib.records.places import RESULTS_ROOT_ENV, default_results_root

    copied, edited = working_copies(folder, notebooks_dir)
    if copied:
        print(f"copied {', '.join(copied)} into {folder}")
    for name in edited:
        print(f"kept {folder / name}.ipynb, whose cells differ from the built-in notebook's (delete it for the current one)")
    results = default_results_root().resolve()
    results.mkdir(parents=True, exist_ok=True)
    link = folder / "results"
    if not link.exists() and not link.is_symlink():
        try:
            link.symlink_to(results, target_is_directory=True)
        except OSError:
            pass  # browsing results from the lab is a convenience: the runs still go to `results`
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # Jupyter refuses root without it
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={folder.resolve()}", *root, *jupyter_args]
    print(f"JupyterLab on {folder.resolve()}; runs go to {results}", flush=True)
    os.execve(sys.executable, command, {**os.environ, RESULTS_ROOT_ENV: str(results)})
