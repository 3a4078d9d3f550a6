"""A benchmark declared by another package, found through the `benchlib.benchmarks` entry-point group,
runs end to end without touching benchlib; the registry refuses broken or duplicate declarations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from benchlib.benchmark import Benchmark, DeclarationError, Parameter, ParameterError

PACKAGE = '''
"""A tiny benchmark another package declares: the memory and time of summing n ones, two ways."""
import numpy as np
import plotly.graph_objects as go

from benchlib import Benchmark, Parameter
from benchlib.measure import measure


def _measure(config, device):
    rows = []
    for variant, fn in (("sum", lambda: np.ones(config.n).sum()), ("cumsum", lambda: np.ones(config.n).cumsum()[-1])):
        for trial in range(config.trials):
            m = measure(fn, device=device, repeats=2, track_allocations=False, name=f"n={config.n}")
            rows += m.records(benchmark="tiny_sum", engine=variant, dtype="float64",
                              params={"n": config.n, "trial": trial, "trials": config.trials})
    return rows


def _peaks(records):
    rows = records[records["metric"] == "peak_bytes"]
    return go.Figure(go.Bar(x=rows["variant"], y=rows["value"]), layout={"title": "tiny_sum peak"})


BENCHMARK = Benchmark(
    name="tiny_sum", question="Does cumsum need more memory than sum?", cases="sum and cumsum of n ones, `trials` times",
    parameters=(Parameter("n", 100_000, "elements", quick=1000, minimum=1),
                Parameter("trials", 3, "trials per variant", quick=2, minimum=1)),
    measure=_measure, headline=("peak_bytes", "time"), figures={"peaks": _peaks})
'''


def _install(root: Path, body: str, entries: dict[str, str]) -> dict[str, str]:
    """A package `tinybench` with its dist-info (entry points) under `root`; the environment that finds it."""
    (root / "tinybench").mkdir(parents=True)
    (root / "tinybench" / "__init__.py").write_text(textwrap.dedent(body))
    info = root / "tinybench-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinybench\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[benchlib.benchmarks]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _benchlib(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchlib.runner.cli", *args], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_an_entry_point_benchmark_lists_runs_reports_and_compares(tmp_path):
    env = _install(tmp_path / "site", PACKAGE, {"tiny_sum": "tinybench:BENCHMARK"})
    listing = _benchlib(env, "list", "tiny_sum")
    assert listing.returncode == 0, listing.stderr
    assert "Does cumsum need more memory than sum?" in listing.stdout and "n: int = 100000  (quick: 1000)" in listing.stdout
    assert "measures: sum and cumsum of n ones, `trials` times" in listing.stdout

    refused = _benchlib(env, "run", "tiny_sum", "-p", "n=0", "--out", str(tmp_path / "out"))
    assert refused.returncode == 2 and "tiny_sum: n must be an integer >= 1, got 0" in refused.stderr
    assert not (tmp_path / "out").exists()

    runs = []
    for _ in range(2):
        done = _benchlib(env, "run", "tiny_sum", "--quick", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "out"))
        assert done.returncode == 0, done.stdout + done.stderr
        runs.append(Path(done.stdout.split("report: ")[1].strip()).parent)
    run = runs[0]
    records = pd.read_parquet(run / "records.parquet")
    assert set(records["benchmark"]) == {"tiny_sum"} and set(records["variant"]) == {"sum", "cumsum"}
    assert (records["metric"] == "time").sum() == 2 * 2 * 2  # variants x quick trials x repeats
    info = json.loads((run / "run.json").read_text())
    assert info["notebooks"]["tiny_sum"]["status"] == "ok"
    assert info["benchmarks"]["tiny_sum"]["question"] == "Does cumsum need more memory than sum?"
    headline = pd.read_parquet(run / "tables" / "tiny_sum_headline.parquet")
    assert set(headline["metric"]) == {"peak_bytes", "time"} and set(headline["n"]) == {2, 4}
    page = (run / "report.html").read_text()
    assert "id='tiny_sum'" in page and "Does cumsum need more memory than sum?" in page and "tiny_sum_peaks" in page
    assert (run / "verdicts.parquet").is_file()

    compared = _benchlib(env, "compare", str(runs[0]), str(runs[1]), "--format", "table")
    assert compared.returncode in (0, 1), compared.stderr  # 1 only if timing noise reads as worse
    assert "tiny_sum" in compared.stdout and "verdicts: none changed" in compared.stdout


@pytest.mark.slow
def test_discovery_names_the_module_of_a_broken_or_duplicate_declaration(tmp_path):
    env = _install(tmp_path / "dup", PACKAGE, {"again": "tinybench:BENCHMARK", "tiny_sum": "tinybench:BENCHMARK"})
    duplicate = _benchlib(env, "list")
    assert duplicate.returncode == 2
    assert "declares benchmark 'tiny_sum', which entry point 'again'" in duplicate.stderr
    env = _install(tmp_path / "bad", "BENCHMARK = 42\n", {"tiny_sum": "tinybench:BENCHMARK"})
    broken = _benchlib(env, "list")
    assert broken.returncode == 2 and "(tinybench:BENCHMARK) is a int, not a benchlib.Benchmark" in broken.stderr
    env = _install(tmp_path / "missing", "raise ImportError('no such thing')\n", {"tiny_sum": "tinybench:BENCHMARK"})
    failing = _benchlib(env, "list")
    assert failing.returncode == 2 and "failed to load: ImportError: no such thing" in failing.stderr


def test_a_declaration_is_checked_when_it_is_made():
    with pytest.raises(DeclarationError, match="give exactly one of notebook"):
        Benchmark(name="b", question="q?", parameters=())
    with pytest.raises(DeclarationError, match="question must say"):
        Benchmark(name="b", question=" ", parameters=(), measure=print)
    with pytest.raises(ParameterError, match="n must be an integer >= 1, got 0"):
        Parameter("n", 0, "a size", minimum=1)  # a default its own bounds refuse
    with pytest.raises(ParameterError, match="n must be an integer >= 1, got 0"):
        Parameter("n", 5, "a size", quick=0, minimum=1)
    with pytest.raises(DeclarationError, match="a list default must be non-empty and of one type"):
        Parameter("sizes", [], "sizes")
    with pytest.raises(DeclarationError, match="device"):
        Parameter("device", "cpu", "injected by the runner")


def test_declaring_registers_nothing_and_one_explicit_step_registers_what_it_declares():
    from benchlib.records import METRICS, make_record
    from benchlib.records.schema import RecordError

    declared = Benchmark(name="explicit_probe", question="q?", parameters=(Parameter("n", 2, "a size"),),
                         measure=print, metrics=(("explicit_probe_count", "count", "count", "a probe's count"),))
    with pytest.raises(RecordError, match="unknown metric .explicit_probe_count."):
        make_record(benchmark="explicit_probe", case="c", engine="e", device="cpu", dtype="float32",
                    metric="explicit_probe_count", value=1)
    assert declared.config({"n": 3}).n == 3  # a Config is what every measurement starts from: it registers
    assert METRICS["explicit_probe_count"].unit == "count"
    assert declared.register() is declared  # again: the same meaning twice is fine
    with pytest.raises(DeclarationError, match="metrics: unit of 'bad' must be one of"):  # checked when declared
        Benchmark(name="b", question="q?", parameters=(), measure=print, metrics=(("bad", "furlongs", "count", "?"),))
    clash = Benchmark(name="clash", question="q?", parameters=(), measure=print,
                      metrics=(("explicit_probe_count", "B", "memory", "another meaning"),))
    with pytest.raises(DeclarationError, match="already registered"):
        clash.register()


@pytest.mark.parametrize(("default", "text", "value"), [
    (3, "5", 5), (0.5, "1", 1.0), (True, "False", False), (True, "false", False), (False, " TRUE", True),
    ("a", "123", "123"), ((1, 2), "[3, 4]", (3, 4)),
    (("x",), "y,z", ("y", "z")), (("x",), "['y']", ("y",)),
])
def test_a_parameter_parses_command_line_text_by_its_type(default, text, value):
    assert Parameter("p", default, "help").parse(text) == value


@pytest.mark.parametrize(("parameter", "bad", "message"), [
    (Parameter("n", 3, "h", minimum=1, maximum=10), 11, "n must be an integer >= 1 and <= 10, got 11"),
    (Parameter("n", 3, "h"), True, "n must be an integer, got True"),
    (Parameter("kind", "a", "h", choices=("a", "b")), "c", "kind must be one of a, b, got 'c'"),
    (Parameter("kinds", ("a",), "h", choices=("a", "b")), ["a", "c"], "kinds must be a non-empty list, each one of a, b"),
    (Parameter("sizes", (1,), "h", minimum=1), [], "sizes must be a non-empty list, each an integer >= 1, got []"),
    (Parameter("x", 1.0, "h"), float("nan"), "x must be a number, got nan"),
    (Parameter("download", True, "h"), "no", "download must be True or False, got 'no'"),
])
def test_a_parameter_refuses_saying_what_is_valid(parameter, bad, message):
    with pytest.raises(ParameterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parameter.check(bad)


def test_every_builtin_refuses_a_bad_value_of_every_parameter_with_exit_2(tmp_path, capsys):
    from benchlib.registry import benchmarks
    from benchlib.runner.cli import main

    for benchmark in benchmarks().values():
        for parameter in benchmark.parameters:
            bad = "[]" if parameter.is_list else ("-1" if parameter.item_type in (int, float) else "[1]")
            if parameter.item_type is str and not parameter.is_list and not parameter.choices:
                continue  # any text is a valid str (data_dir)
            if parameter.item_type is bool:
                bad = "'yes'"
            code = main(["run", benchmark.name, "-p", f"{parameter.name}={bad}", "--out", str(tmp_path / "out")])
            error = capsys.readouterr().err
            assert code == 2 and f"{benchmark.name}: {parameter.name} must be" in error, (benchmark.name, parameter.name, error)
    assert not (tmp_path / "out").exists()
