"""The results commands of `benchlib`: runs, compare, history, report and merge-records, each a thin
adapter from its parsed arguments to `benchlib.records`, `benchlib.analysis` and `benchlib.report`. Each
returns the command's exit status (docs/setup.md, "Exit status")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from benchlib.runner.arguments import RunnerError


def add_commands(commands, common: Sequence[argparse.ArgumentParser]) -> None:
    runs_parser = commands.add_parser("runs", parents=common, help="past runs under the results directory",
                                      description="List every run under the results root with its state and problems; "
                                                  "exit status 1 when a run's files cannot be read (the problem column).")
    runs_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")

    compare_parser = commands.add_parser(
        "compare", parents=common, help="run B against run A per metric: ratio with 95%% interval, p, better/worse/same/noisy")
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
        "history", parents=common, help="each headline metric over many runs: where it stepped, by how much, better or worse",
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
        "report", parents=common, help="(re)write a run's report.html", description="Write RUN/report.html: environment, verdicts, every figure."
    )
    report_parser.add_argument("run", metavar="RUN", help="a run id (under --out) or a run directory")
    report_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")

    merge_parser = commands.add_parser(
        "merge-records", parents=common, help="rebuild a run's records.parquet from its per-notebook records/*.parquet",
        description="Rebuild RUN/records.parquet from RUN/records/*.parquet (e.g. after a crash or a corrupt file); "
                    "unreadable files are named and skipped, with exit status 1. records.parquet is never replaced by fewer rows "
                    "than it holds (exit 1, the old file kept); no records/ to merge from is exit 2.")
    merge_parser.add_argument("run", metavar="RUN", help="a run id (under --out) or a run directory")
    merge_parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="results root (default: results/)")
    runs_parser.set_defaults(handler=lambda arguments: runs_command(arguments.out))
    compare_parser.set_defaults(handler=compare_command)
    history_parser.set_defaults(handler=history_command)
    report_parser.set_defaults(handler=lambda arguments: report_command(arguments.run, arguments.out))
    merge_parser.set_defaults(handler=lambda arguments: merge_records_command(arguments.run, arguments.out))



def _wrapped(lines: Sequence[str]) -> list[str]:
    """Prose lines folded at the table's width (`compare`'s whole default output stays within it), each
    continuation indented under its line."""
    import textwrap

    from benchlib.analysis.compare import TABLE_WIDTH

    folded = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()))
        folded += textwrap.wrap(line, TABLE_WIDTH, subsequent_indent=indent + "    ", break_on_hyphens=False) or [""]
    return folded


def report_command(run_name: str, root: Path | None) -> int:
    from benchlib.registry import verdict_rules
    from benchlib.report.page import write_report
    from benchlib.analysis.seed_verdicts import load_verdicts, save_verdicts, seed_verdicts
    from benchlib.records.store import RecordsUnreadable, load_records, resolve_run

    path = resolve_run(run_name, root)
    try:
        records = load_records(path)
    except RecordsUnreadable as error:  # the page is still written, saying so: answered, not whole
        records, unreadable = None, error
    else:
        unreadable = None
    if records is not None and load_verdicts(path) is None:  # an older or unfinished run: judged now, as it ends
        save_verdicts(seed_verdicts(records, verdict_rules()), path)
    print(write_report(path))
    if unreadable is None and records.empty:  # a run that measured nothing, or one still running
        unreadable = f"{path}: its records hold no row"
    if unreadable is not None:
        print(f"benchlib: the page shows no measurement: {unreadable}", file=sys.stderr)
        return 1
    return 0


def runs_command(root: Path | None) -> int:
    import pandas as pd

    from benchlib.records import default_results_root, list_runs

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


def compare_command(arguments: argparse.Namespace) -> int:
    """Print the comparison; exit 1 when any metric is significantly worse beyond the threshold."""
    from benchlib import registry
    from benchlib.analysis.compare import (NO_DIRECTION, WORSE, any_worse, compact_table, compare_runs, headline, key_name,
                                          machine_drift, one_sided_text)
    from benchlib.runner.notebooks import declared

    yardsticks = registry.yardsticks(declared())  # every benchmark registered: each metric judged its own way
    comparison = compare_runs(arguments.run_a, arguments.run_b, root=arguments.out, threshold=arguments.threshold,
                              metrics=arguments.metric, benchmarks=arguments.benchmark)
    if comparison.empty:
        raise RunnerError("nothing to compare: no metric with the same benchmark, case, engine, device, dtype "
                          "and config is in both runs")
    if (comparison["label"] == NO_DIRECTION).all():  # a marker (failed, not applicable) or a ratio cannot gate
        raise RunnerError(f"nothing to compare: the only metrics in both runs have no direction "
                          f"({', '.join(sorted(set(comparison['metric'])))}: markers and ratios, never worse or "
                          "better); did a run measure nothing? `benchlib runs` shows each run's status")
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
        drift = machine_drift(comparison, yardsticks)
        prose = [drift or "machine drift: unknown (no yardstick benchmark, such as calibration, is in both runs)",
                 *verdict_changes(arguments).splitlines()]
        print("\n".join(_wrapped(prose)))
    one_sided = one_sided_text(comparison)
    if one_sided:
        print(f"benchlib: {one_sided}", file=sys.stderr)
    if any_worse(comparison):
        worse = comparison[comparison["label"] == WORSE]
        names = [key_name(row) for row in worse.itertuples()]
        more = f", and {len(names) - WORSE_NAMED} more (see the table)" if len(names) > WORSE_NAMED else ""
        print(f"benchlib: {len(names)} worse in B: {', '.join(names[:WORSE_NAMED])}{more}", file=sys.stderr)
        return 1
    return 0


def history_command(arguments: argparse.Namespace) -> int:
    """Print the steps and write history.html; exit 1 when any series' latest step is a regression."""
    import pandas as pd

    from benchlib.analysis.history import (MIN_RUNS, SERIES_COLUMNS, HistoryError, answer, build_series,
                                           ended_series, find_steps, latest_regressions, looked_at, read_history,
                                           without_commit)
    from benchlib.report.history import HISTORY_PAGE, history_page, step_table
    from benchlib.records.places import default_results_root
    from benchlib.records.store import refuse_overwriting_run_data, write_text_atomic
    from benchlib.runner.notebooks import declared

    if arguments.html is not None:  # refused before anything is read, not after the answer is printed
        refuse_overwriting_run_data(arguments.html, HISTORY_PAGE)
    declared()  # every benchmark registered: each metric judged its own way
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
    ended = ended_series(series)
    if ended:
        print(f"benchlib: {len(ended)} series the latest run does not hold (a module, engine or metric renamed or gone; "
              f"not judged there): {', '.join(ended[:5])}{' ...' if len(ended) > 5 else ''}", file=sys.stderr)
    unrecorded = without_commit(series) if arguments.by == "commit" else []
    if unrecorded:
        print(f"{len(unrecorded)} run(s) without a recorded commit (made outside git) are placed by their start time: "
              f"{', '.join(unrecorded[:5])}{' ...' if len(unrecorded) > 5 else ''}")
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


def verdict_changes(arguments: argparse.Namespace) -> str:
    """The seed verdicts that differ between the two runs, one line each (or why none can be told)."""
    from benchlib.analysis.seed_verdicts import changed_verdicts, load_verdicts

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


def merge_records_command(run_name: str, root: Path | None) -> int:
    from benchlib.records import Run
    from benchlib.records.store import RecordsKept, resolve_run

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
