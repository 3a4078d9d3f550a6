"""The `benchlib` command: its parser, and the run, list and new commands (run notebooks and model files,
list them with their parameters, write an example model file); the results commands (runs, compare,
history, report, merge-records) are adapters in `benchlib.runner.results_commands`."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchlib.runner import results_commands
from benchlib.runner.execute import EXIT_INTERRUPTED, run
from benchlib.runner.notebooks import RunnerError, parse_assignment, select_notebooks
from benchlib.runner.sweep import parse_grid

EXIT_REFUSED = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchlib",
        description="Run the benchmark notebooks through papermill and keep their results in results/<run-id>/.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true",
                       help="on an error, also print its traceback (without it, every error is one line)")

    run_parser = commands.add_parser(
        "run", parents=[debug],
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
        "--png", action="store_true",
        help="also save every figure as figures/<name>.png and as PNG in the executed notebooks "
             "(needs kaleido, pip install -e '.[png]', and a Chrome/Chromium; refused otherwise)",
    )

    list_parser = commands.add_parser("list", parents=[debug], help="the benchmarks: their questions, parameters, defaults, quick values and help")
    list_parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK")
    list_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR")

    new_parser = commands.add_parser(
        "new", parents=[debug], help="write a commented example model file to run with `benchlib run FILE`")
    new_parser.add_argument("file", type=Path, metavar="FILE", help="the .py file to write (never overwritten)")
    new_parser.add_argument("--form", choices=("torch", "arrays"), default="torch",
                            help="torch: an nn.Module, a batch and a loss; arrays: NumPy arrays and a loss over xp, "
                                 "run under benchlib's engines, HIPS autograd, torch and torch.func (default: torch)")

    notebooks_parser = commands.add_parser(
        "notebooks", parents=[debug], help="copy the built-in notebooks into a folder, to open in JupyterLab",
        description="Copy the built-in notebooks (those `benchlib list` names) into DIR, created if missing; a "
                    "notebook already there is never overwritten (exit 2, nothing copied). Open them with "
                    "`jupyter lab DIR`; their results go to ./results of the folder you run in.")
    notebooks_parser.add_argument("folder", type=Path, metavar="DIR", help="where to copy them")
    notebooks_parser.add_argument("--notebooks-dir", type=Path, default=None, metavar="DIR",
                                  help="where the notebooks are (default: the project's notebooks/, else the "
                                       "installed copy's)")

    runs_parser = commands.add_parser("runs", parents=[debug], help="past runs under the results directory",
                                      description="List every run under the results root with its state and problems; "
                                                  "exit status 1 when a run's files cannot be read (the problem column).")
    runs_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")

    compare_parser = commands.add_parser(
        "compare", parents=[debug], help="run B against run A per metric: ratio with 95%% interval, p, better/worse/same/noisy")
    compare_parser.add_argument("run_a", metavar="RUN_A", help="run id or run directory (the baseline)")
    compare_parser.add_argument("run_b", metavar="RUN_B",
                                help="run id or run directory (the candidate); `latest` is the newest run under --out")
    compare_parser.add_argument("--metric", action="append", default=[], help="only this metric (repeatable)")
    compare_parser.add_argument("--benchmark", action="append", default=[], help="only this benchmark (repeatable)")
    compare_parser.add_argument("--threshold", type=float, default=0.05, help="minimum relative change (default 0.05)")
    compare_parser.add_argument("--format", choices=("table", "csv", "json"), default="table",
                                help="table: the answer, then one line per metric within 120 columns (default); csv, "
                                     "json: every column")
    compare_parser.add_argument("--full", action="store_true",
                                help="with --format table, every column of every metric (wide)")
    compare_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root for run ids")

    history_parser = commands.add_parser(
        "history", parents=[debug], help="each headline metric over many runs: where it stepped, by how much, better or worse",
        description="Each headline metric of the runs (or every run under --out) as a series, one point per run "
                    "(the median of its trials), in commit order; change points (ruptures) checked by a ratio of "
                    "medians with 95%% interval. Prints the steps and writes history.html beside the runs. Exit "
                    "status: 0 no step, or every series' latest step an improvement; 1 a series' latest step is a "
                    "regression, or a run could not be read (named, left out); 2 bad input (no runs, fewer than 3 runs of any series, unknown names, runs without "
                    "a commit under --by commit).")
    history_parser.add_argument("runs", nargs="*", metavar="RUN",
                                help="run ids (under --out) or run directories (default: every run under --out)")
    history_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")
    history_parser.add_argument("--benchmark", action="append", default=[], help="only this benchmark (repeatable)")
    history_parser.add_argument("--metric", action="append", default=[],
                                help="only this metric, headline or not (repeatable; default: each benchmark's headline)")
    history_parser.add_argument("--threshold", type=float, default=0.05,
                                help="minimum relative change of a step (default 0.05)")
    history_parser.add_argument("--by", choices=("commit", "time"), default="commit",
                                help="order runs by the commit they measured (runs of one commit together, commits "
                                     "by their first run; the default) or by start time alone")
    history_parser.add_argument("--html", type=Path, default=None, metavar="PATH",
                                help="where to write the page (default: history.html in the runs' results root)")

    report_parser = commands.add_parser(
        "report", parents=[debug], help="(re)write a run's report.html", description="Write RUN/report.html: environment, verdicts, every figure."
    )
    report_parser.add_argument("run", metavar="RUN", help="a run id (under --out) or a run directory")
    report_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")

    fit_parser = commands.add_parser(
        "fit", parents=[debug], help="the largest batch (or sequence length) a model file's step fits in a memory limit",
        description="Measure the step of a model file under each engine at an eighth, a quarter, a half and all of "
                    "the --scale parameter's value (one fresh process each), fit each engine's total memory with a "
                    "linear or quadratic size model (the one that predicts the largest point best from the others), "
                    "and print the largest value predicted to fit --memory, the fastest engine first. Total memory: "
                    "the allocator's reserved peak on CUDA, the process's resident high-water mark on the CPU. "
                    "Exit status: 0 some engine fits, 1 none fits at the smallest value, 2 refused.")
    fit_parser.add_argument("file", metavar="FILE", help="a model file in the torch form (see `benchlib new`)")
    fit_parser.add_argument("--memory", required=True, metavar="SIZE", help="the limit: '24 GB', '80 GiB', bytes")
    fit_parser.add_argument("--scale", required=True, metavar="PARAM",
                            help="an integer parameter of the file that memory grows with (batch_size, seq_len)")
    fit_parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    fit_parser.add_argument("--engines", default=None, metavar="A,B", help="engines to fit (default: all of the form's)")
    fit_parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                            help="a parameter value, as for run (the --scale one sets the largest value measured)")
    fit_parser.add_argument("--verify", action="store_true",
                            help="measure the best engine at its largest fitting value (where this machine has the "
                                 "memory) and print predicted against measured")
    fit_parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                            help="root for the run directory its records and report go to (default: results/)")

    merge_parser = commands.add_parser(
        "merge-records", parents=[debug], help="rebuild a run's records.parquet from its per-notebook records/*.parquet",
        description="Rebuild RUN/records.parquet from RUN/records/*.parquet (e.g. after a crash or a corrupt file); "
                    "unreadable files are named and skipped, with exit status 1. records.parquet is never replaced by fewer rows "
                    "than it holds (exit 1, the old file kept); no records/ to merge from is exit 2.")
    merge_parser.add_argument("run", metavar="RUN", help="a run id (under --out) or a run directory")
    merge_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")
    return parser


def _list(names: Sequence[str], notebooks_dir: Path | None) -> int:
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
    import shutil

    from benchlib.runner.notebooks import available_notebooks, find_project_notebooks

    source = notebooks_dir or find_project_notebooks()
    notebooks = available_notebooks(source)
    taken = [name for name in notebooks if (folder / f"{name}.ipynb").exists()]
    if taken:
        raise RunnerError(f"{folder} already holds {', '.join(f'{name}.ipynb' for name in taken)}; benchlib notebooks "
                          "never overwrites a notebook (choose an empty folder)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, path in notebooks.items():
            shutil.copyfile(path, folder / f"{name}.ipynb")
    except OSError as error:
        raise RunnerError(f"{folder} cannot be written: {error.strerror}") from None
    print(f"copied {len(notebooks)} notebooks from {source} to {folder}: {', '.join(notebooks)}")
    return 0


def _new(path: Path, form: str) -> int:
    from benchlib.usermodel.template import ARRAY_TEMPLATE, TEMPLATE

    if path.suffix != ".py":
        raise RunnerError(f"{path}: a model file ends in .py")
    try:
        with open(path, "x", encoding="utf-8") as file:
            file.write(ARRAY_TEMPLATE if form == "arrays" else TEMPLATE)
    except FileExistsError:
        raise RunnerError(f"{path} exists; benchlib new never overwrites a file (choose another name)") from None
    except OSError as error:
        raise RunnerError(f"{path} cannot be written: {error.strerror}") from None
    print(f"wrote {path}; try it: benchlib run {path} --quick")
    return 0


def _print_chain(error: BaseException) -> None:
    """The refusal's traceback and those of the errors behind it, the original first (for --debug)."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    for link in reversed(chain):
        traceback.print_exception(type(link), link, link.__traceback__, chain=False)
        if getattr(link, "child_traceback", ""):  # raised in a child process: where, in that child
            print(f"--- in the child process ---\n{link.child_traceback.rstrip()}", file=sys.stderr)


def _params(assignments: Sequence[str]) -> dict[str, str]:
    """`-p NAME=VALUE` assignments as a dict; a name given twice is refused (which one would win is a guess)."""
    params: dict[str, str] = {}
    for text in assignments:
        name, value = parse_assignment(text)
        if name in params:
            raise RunnerError(f"-p {name} is given twice ({params[name]!r} and {value!r}); give each parameter once")
        params[name] = value
    return params


def _run(arguments: argparse.Namespace, argv: Sequence[str] | None) -> int:
    result = run(
        arguments.notebooks,
        device=arguments.device,
        params=_params(arguments.param),
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
        command=["benchlib", *(sys.argv[1:] if argv is None else argv)],
    )
    return result.exit_code


def _command(arguments: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """The exit status of the command `arguments` names."""
    if arguments.command == "list":
        return _list(arguments.notebooks, arguments.notebooks_dir)
    if arguments.command == "runs":
        return results_commands.runs_command(arguments.out)
    if arguments.command == "compare":
        return results_commands.compare_command(arguments)
    if arguments.command == "history":
        return results_commands.history_command(arguments)
    if arguments.command == "report":
        return results_commands.report_command(arguments.run, arguments.out)
    if arguments.command == "merge-records":
        return results_commands.merge_records_command(arguments.run, arguments.out)
    if arguments.command == "fit":
        from benchlib.runner.fit_command import fit_command

        return fit_command(arguments.file, memory=arguments.memory, scale=arguments.scale, device=arguments.device,
                           engines=arguments.engines, params=_params(arguments.param), verify=arguments.verify,
                           out=arguments.out)
    if arguments.command == "new":
        return _new(arguments.file, arguments.form)
    if arguments.command == "notebooks":
        return _copy_notebooks(arguments.folder, arguments.notebooks_dir)
    return _run(arguments, argv)


def one_line(error: BaseException) -> str:
    """What went wrong, for a user: a refusal's own message (it says what is valid); for an OS error
    the file and what is wrong with it; anything else by its type (a bug: --debug shows where)."""
    if isinstance(error, OSError) and error.filename is not None:
        files = f"{error.filename} -> {error.filename2}" if error.filename2 is not None else str(error.filename)
        return f"{files}: {error.strerror or error}"
    if isinstance(error, (ValueError, OSError)):  # RunnerError, RecordsUnreadable, HistoryError... name their file
        return str(error)
    return f"{type(error).__name__}: {error} (--debug shows the traceback)"


class _ReaderSafe:
    """stdout whose reader may leave early (`benchlib compare A B | head -1`): what follows is dropped, so
    the command still finishes and exits with its own status instead of failing on a broken pipe."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def _reader_left(self) -> None:
        self._gone = True
        try:  # later flushes, the interpreter's last one included, go nowhere instead of failing again
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `benchlib` command; returns the exit status (README, "Exit status"): an
    error ends as one line, `benchlib: error: ...`, and 2; its traceback only with --debug. Output to a
    reader that left early changes no exit status."""
    stdout = sys.stdout
    sys.stdout = _ReaderSafe(stdout)
    try:
        return _main(argv)
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    arguments = _parser().parse_args(argv)
    try:
        return _command(arguments, argv)
    except KeyboardInterrupt:
        print("benchlib: interrupted; everything written so far is kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # every command's errors end here, so none prints a traceback without --debug
        if arguments.debug:
            _print_chain(error)
        print(f"benchlib: error: {one_line(error)}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
