"""The `benchlib` command: run notebooks and model files, list them with their parameters, write an example
model file, list past runs, compare two runs, find the steps in a history of runs."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchlib.runner.execute import EXIT_INTERRUPTED, run
from benchlib.runner.sweep import parse_grid
from benchlib.runner.notebooks import RunnerError, declared, parse_assignment, select_notebooks

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

    merge_parser = commands.add_parser(
        "merge-records", parents=[debug], help="rebuild a run's records.parquet from its per-notebook records/*.parquet",
        description="Rebuild RUN/records.parquet from RUN/records/*.parquet (e.g. after a crash or a corrupt file); "
                    "unreadable files are named and skipped, with exit status 1. records.parquet is never replaced by fewer rows "
                    "than it holds (exit 1, the old file kept); no records/ to merge from is exit 2.")
    merge_parser.add_argument("run", metavar="RUN", help="a run id (under --out) or a run directory")
    merge_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")
    return parser


def _report(run_name: str, root: Path | None) -> int:
    from benchlib.registry import verdict_rules
    from benchlib.results.report import write_report
    from benchlib.results.seed_verdicts import load_verdicts, save_verdicts, seed_verdicts
    from benchlib.results.store import RecordsUnreadable, load_records, resolve_run

    path = resolve_run(run_name, root)
    unjudged = None
    if load_verdicts(path) is None:  # an older or unfinished run: judge its records now, as a finished run does
        try:
            save_verdicts(seed_verdicts(load_records(path), verdict_rules()), path)
        except RecordsUnreadable as error:  # the page is still written, without verdicts: answered, not whole
            unjudged = error
    print(write_report(path))
    if unjudged is not None:
        print(f"benchlib: no verdicts: {unjudged}", file=sys.stderr)
        return 1
    return 0


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


def _runs(root: Path | None) -> int:
    import pandas as pd

    from benchlib.results import default_results_root, list_runs

    root = root or default_results_root()
    try:
        runs = list_runs(root)
    except FileNotFoundError as missing:
        raise RunnerError(f"{missing} (--out names the directory that holds runs)") from None
    if runs.empty:
        print(f"no runs yet in {root}")
        return 0
    copies = runs["run_id"].duplicated(keep=False)
    shown = runs if copies.any() else runs.drop(columns=["path"])  # one id in two places: the paths tell them apart
    if not shown["problem"].astype(bool).any():
        shown = shown.drop(columns=["problem"])
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_colwidth", 90):
        print(f"runs in {root}:")
        print(shown.to_string(index=False))
    if copies.any():
        print(f"benchlib: {int(copies.sum())} directories share a run id ({', '.join(sorted(set(runs['run_id'][copies])))}):"
              " copies of one run; `history` counts each once", file=sys.stderr)
    problems = int(runs["problem"].astype(bool).sum())
    if problems:  # listed, and the exit says so: answered, but some runs cannot be read
        print(f"benchlib: {problems} run(s) with files that cannot be read (the problem column)", file=sys.stderr)
        return 1
    return 0


WORSE_NAMED = 20  # worse metrics named on stderr; the table lists them all


def _compare(arguments: argparse.Namespace) -> int:
    """Print the comparison; exit 1 when any metric is significantly worse beyond the threshold."""
    from benchlib import registry
    from benchlib.results.compare import WORSE, any_worse, compact_table, compare_runs, headline, machine_drift

    comparison = compare_runs(arguments.run_a, arguments.run_b, root=arguments.out, threshold=arguments.threshold,
                              metrics=arguments.metric, benchmarks=arguments.benchmark)
    if comparison.empty:
        raise RunnerError("nothing to compare: no metric with the same benchmark, case, engine, device, dtype "
                          "and config is in both runs")
    if arguments.format == "csv":
        print(comparison.to_csv(index=False), end="")
    elif arguments.format == "json":
        print(comparison.to_json(orient="records", indent=1))
    else:
        # the answer first (counts, worst regressions); the table leaves out the config JSON (csv and json keep it)
        print("\n".join(headline(comparison)), end="\n\n")
        if arguments.full:
            print(comparison.drop(columns=["config"]).to_string(index=False))
        else:
            print("\n".join(compact_table(comparison)))
        drift = machine_drift(comparison, registry.yardsticks(declared()))
        print(drift or "machine drift: unknown (calibration is not in both runs)")
        print(_verdict_changes(arguments))
    if any_worse(comparison):
        worse = comparison[comparison["label"] == WORSE]
        names = [f"{row.benchmark}/{row.case}/{row.variant}/{row.metric}" for row in worse.itertuples()]
        more = f", and {len(names) - WORSE_NAMED} more (see the table)" if len(names) > WORSE_NAMED else ""
        print(f"benchlib: {len(names)} worse in B: {', '.join(names[:WORSE_NAMED])}{more}", file=sys.stderr)
        return 1
    return 0


def _history(arguments: argparse.Namespace) -> int:
    """Print the steps and write history.html; exit 1 when any series' latest step is a regression."""
    import pandas as pd

    from benchlib.results.history import (HISTORY_PAGE, MIN_RUNS, SERIES_COLUMNS, HistoryError, answer, build_series,
                                          find_steps, history_page, latest_regressions, looked_at, read_history,
                                          step_table)
    from benchlib.results.store import default_results_root, refuse_overwriting_run_data, write_text_atomic

    if arguments.html is not None:  # refused before anything is read, not after the answer is printed
        refuse_overwriting_run_data(arguments.html, HISTORY_PAGE)
    history = read_history(arguments.runs, arguments.out)
    for message in history.skipped:
        print(f"skipped: {message}", file=sys.stderr)
    if history.records.empty:
        where = "the runs given" if arguments.runs else str(arguments.out or default_results_root())
        raise HistoryError(f"no runs with records in {where}"
                           + (f" ({len(history.skipped)} skipped, named above)" if history.skipped else ""))
    series = build_series(history.records, headlines=history.headlines, benchmarks=arguments.benchmark,
                          metrics=arguments.metric, by=arguments.by)
    if series.empty:
        raise HistoryError("the runs hold no headline metric with a better direction (--metric names others)")
    if looked_at(series).empty:
        most = int(series.groupby(SERIES_COLUMNS)["run_id"].nunique().max())
        raise HistoryError(f"fewer than {MIN_RUNS} runs in every series (the most: {most} of {series['run_id'].nunique()} "
                           "runs read): a step needs runs on both sides of it to tell it from noise")
    steps = find_steps(series, threshold=arguments.threshold)
    print(answer(steps, series))
    if not steps.empty:
        print()
        with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_colwidth", 90):
            print(step_table(steps).to_string(index=False))
    latest = series.sort_values("started").iloc[-1]
    page = refuse_overwriting_run_data(arguments.html or history.paths[latest["run_id"]].parent / HISTORY_PAGE,
                                       HISTORY_PAGE)
    write_text_atomic(history_page(series, steps, by=arguments.by, skipped=history.skipped), page)
    print(f"page: {page}")
    return 1 if history.unreadable or not latest_regressions(steps).empty else 0


def _verdict_changes(arguments: argparse.Namespace) -> str:
    """The seed verdicts that differ between the two runs, one line each (or why none can be told)."""
    from benchlib.results.seed_verdicts import changed_verdicts, load_verdicts

    tables = [load_verdicts(run, arguments.out) for run in (arguments.run_a, arguments.run_b)]
    if any(table is None for table in tables):
        return "verdicts: not compared (a run has no verdicts.parquet; `benchlib report RUN` writes it)"
    if arguments.benchmark:
        tables = [table[table["benchmark"].isin(arguments.benchmark)] for table in tables]
    changed = changed_verdicts(*tables)
    if changed.empty:
        return "verdicts: none changed"
    lines = [f"verdicts: {len(changed)} changed"]
    for row in changed.itertuples():
        where = ", ".join(part for part in (row.group, row.grid_point) if isinstance(part, str) and part)
        lines.append(f"  {row.verdict_a} -> {row.verdict_b}  {row.benchmark}: {row.claim}" + (f" [{where}]" if where else ""))
    return "\n".join(lines)


def _merge_records(run_name: str, root: Path | None) -> int:
    from benchlib.results import Run
    from benchlib.results.store import RecordsKept, resolve_run

    path = resolve_run(run_name, root)
    if not any((path / "records").glob("*.parquet")):
        raise RunnerError(f"{path / 'records'} holds no per-notebook records: nothing to merge; records.parquet is left as it is")
    try:
        skipped = Run(path, {"run_id": path.name}).refresh_records(skip_unreadable=True)
    except RecordsKept as kept:
        for message in kept.skipped:
            print(f"skipped: {message}", file=sys.stderr)
        print(f"benchlib: {kept}", file=sys.stderr)
        return 1
    for message in skipped:
        print(f"skipped: {message}", file=sys.stderr)
    print(f"{path / 'records.parquet'} rebuilt from {path / 'records'}" + (f" ({len(skipped)} file(s) skipped)" if skipped else ""))
    return 1 if skipped else 0


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
        return _runs(arguments.out)
    if arguments.command == "compare":
        return _compare(arguments)
    if arguments.command == "history":
        return _history(arguments)
    if arguments.command == "report":
        return _report(arguments.run, arguments.out)
    if arguments.command == "merge-records":
        return _merge_records(arguments.run, arguments.out)
    if arguments.command == "new":
        return _new(arguments.file, arguments.form)
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
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
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
