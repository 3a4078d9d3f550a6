"""Property tests: the command-line value parsers over odd, unicode, empty and huge inputs (each
parses to a value its parameter accepts, or is refused by a message naming what is valid, never
another exception); records written then read back, and merges that never lose rows."""

from __future__ import annotations

import string

import numpy as np
import pandas as pd
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a dev dependency: pip install -e '.[dev]'")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from benchlib.benchmark import Parameter, ParameterError  # noqa: E402
from benchlib.records import Run, load_records, make_record  # noqa: E402
from benchlib.records.store import RecordsKept, read_records_file, rows_held, write_records_atomic  # noqa: E402
from benchlib.runner.arguments import parse_assignment  # noqa: E402
from benchlib.runner.arguments import RunnerError  # noqa: E402
from benchlib.runner.arguments import parse_grid  # noqa: E402

MANY = settings(max_examples=1000, deadline=None)
SOME = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

PARAMETERS = [
    Parameter("depth", 100, "an int", minimum=1),
    Parameter("scale", 1.0, "a float", minimum=0.0, maximum=1e6),
    Parameter("flag", False, "a bool"),
    Parameter("dtype", "float64", "a choice", choices=("float32", "float64")),
    Parameter("label", "x", "any text"),
    Parameter("sizes", (1, 2), "a list of int", minimum=0),
    Parameter("engines", ("torch",), "a list of choices", choices=("torch", "manual", "autograd")),
    Parameter("rates", (0.5,), "a list of float"),
]

# What a user may type: anything, literals of every kind, numbers past float's range, deep nesting, long text.
TEXT = st.one_of(
    st.text(),
    st.text(alphabet=string.printable, max_size=40),
    st.integers().map(str),
    st.integers(min_value=10**300, max_value=10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none()), max_size=6).map(repr),
    st.lists(st.sampled_from(["torch", "manual", "jax", "", " "]), max_size=5).map(",".join),
    st.integers(min_value=0, max_value=3000).map(lambda depth: "[" * depth + "1" + "]" * depth),
    st.integers(min_value=0, max_value=3000).map(lambda depth: "(" * depth),
    st.sampled_from(["", " ", "None", "True", "1j", "{1, 2}", "{'a': 1}", "b'x'", "1e999", "-0.0", "nan", "0x10",
                     "1_000", "´", "\x00", "[]", "()", "[,]", "é,ü", "𝟙", "9" * 5000]),
    st.text(min_size=2000, max_size=20000),
)


@MANY
@given(parameter=st.sampled_from(PARAMETERS), text=TEXT)
def test_a_parameter_parses_to_a_value_it_accepts_or_refuses_saying_what_is_valid(parameter, text):
    try:
        value = parameter.parse(text)
    except ParameterError as refused:
        assert parameter.valid() in str(refused) and str(refused).startswith(parameter.name)
        return
    assert parameter.check(value) == value


@MANY
@given(text=st.one_of(TEXT, st.tuples(st.sampled_from(["depth", "x", "", " a ", "1a", "é"]), TEXT).map("=".join)))
def test_an_assignment_is_a_name_and_its_text_or_is_refused_with_the_form(text):
    try:
        name, value = parse_assignment(text)
    except RunnerError as refused:
        assert "-p takes NAME=VALUE" in str(refused)
        return
    assert name.isidentifier() and text.partition("=")[2] == value


@MANY
@given(assignments=st.lists(st.one_of(TEXT, st.tuples(st.sampled_from(["D", "dtype", "D "]), TEXT).map("=".join)),
                            max_size=3))
def test_a_grid_is_lists_of_distinct_values_or_is_refused_naming_the_grid(assignments):
    try:
        grid = parse_grid(assignments)
    except RunnerError as refused:
        assert "--grid" in str(refused)
        return
    for name, values in grid.items():
        assert name.isidentifier() and isinstance(values, list) and values
        assert len(set(map(repr, values))) == len(values)


LABEL = st.text(min_size=1, max_size=12).filter(lambda text: text.strip() == text and "\x00" not in text)


def records(count: int, benchmark: str, values) -> list[dict]:
    return [make_record(benchmark=benchmark, case="c", engine=f"e{index % 3}", device="cpu", dtype="float64",
                        metric="time", value=value, unit="s", params={"trial": index})
            for index, value in zip(range(count), values)]


@SOME
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=40), case=LABEL,
       extra=st.dictionaries(LABEL, st.one_of(st.integers(), st.text(max_size=20), st.booleans()), max_size=3))
def test_records_written_then_read_round_trip(tmp_path_factory, values, case, extra):
    frame = pd.DataFrame([make_record(benchmark="b", case=case, engine="e", device="cpu", dtype="float64",
                                      metric="time", value=value, unit="s", params={**extra, "trial": index})
                          for index, value in enumerate(values)])
    path = tmp_path_factory.mktemp("round") / "records.parquet"
    write_records_atomic(frame, path)
    back = read_records_file(path)
    assert len(back) == len(values) and rows_held(path) == len(values)
    np.testing.assert_array_equal(back["value"].to_numpy(dtype=float), np.asarray(values, dtype=float))
    assert set(back["case"]) == {case}
    write_records_atomic(back, path)
    pd.testing.assert_frame_equal(read_records_file(path), back)


@pytest.mark.slow  # its run's environment asks git for the commit
@SOME
@given(sizes=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4),
       broken=st.lists(st.booleans(), min_size=4, max_size=4), removed=st.lists(st.booleans(), min_size=4, max_size=4))
def test_a_merge_never_yields_fewer_rows_than_it_found(tmp_path_factory, sizes, broken, removed):
    run_ = Run.create(tmp_path_factory.mktemp("merge"), "cpu")
    for index, size in enumerate(sizes):
        run_.save_records(records(size, f"b{index}", [1.0] * size), f"b{index}")
    held = rows_held(run_.path / "records.parquet")
    assert held == sum(sizes)
    for index in range(len(sizes)):  # the fragments as a crash or a user may leave them
        fragment = run_.path / "records" / f"b{index}.parquet"
        if removed[index]:
            fragment.unlink()
        elif broken[index]:
            fragment.write_bytes(fragment.read_bytes()[: len(fragment.read_bytes()) // 2])
    try:
        skipped = run_.refresh_records(skip_unreadable=True)
    except RecordsKept as kept:
        assert len(kept.skipped) == sum(1 for i in range(len(sizes)) if broken[i] and not removed[i])
    else:
        assert len(skipped) == sum(1 for i in range(len(sizes)) if broken[i] and not removed[i])
    assert len(load_records(run_.path)) >= held


# The loaders over hostile files: any JSON value as run.json, any bytes as a records file, any text as a run's
# name. Never a traceback, never a good run hidden, never a file changed.
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
RUN_KEYS = st.fixed_dictionaries({}, optional={"run_id": JSON, "started_at": JSON, "ended_at": JSON,
                                               "environment": JSON, "notebooks": JSON, "runner": JSON,
                                               "interrupted": JSON})


def _beside_a_good_run(root):
    from pathlib import Path

    good = Run._start(Path(root) / "good", "good", "cpu", None, {})
    good.save_records([make_record(benchmark="b", case="c", engine="torch", device="cpu", dtype="float32",
                                   metric="peak_bytes", value=1.0, unit="B")], "b")
    good.finish()
    return good


def _files(root) -> dict:
    from pathlib import Path

    return {str(path): path.read_bytes() for path in Path(root).rglob("*") if path.is_file()}


@pytest.mark.slow  # its run's environment asks git for the commit
@SOME
@given(content=st.one_of(JSON.map(lambda value: __import__("json").dumps(value)),
                         RUN_KEYS.map(lambda value: __import__("json").dumps(value)),
                         st.binary(max_size=200).map(lambda raw: raw.decode("latin-1"))))
def test_any_run_json_is_listed_with_its_problem_and_hides_no_good_run(tmp_path_factory, content):
    from benchlib.records.store import RecordsUnreadable, list_runs, load_run_info

    root = tmp_path_factory.mktemp("runs")
    _beside_a_good_run(root)
    (root / "odd").mkdir()
    (root / "odd" / "run.json").write_text(content, encoding="latin-1")
    before = _files(root)
    runs = list_runs(root).set_index("run_id", drop=False)
    assert runs.loc["good", "state"] == "finished" and runs.loc["good", "records"] == 1
    assert len(runs) == 2  # the odd one listed, never left out
    try:
        load_run_info(root / "odd")
    except (RecordsUnreadable, FileNotFoundError) as error:
        assert "run.json" in str(error)  # named, whatever it held
    assert _files(root) == before


@pytest.mark.slow  # its run's environment asks git for the commit
@SOME
@given(raw=st.binary(max_size=400))
def test_any_bytes_as_a_records_file_are_refused_naming_the_file(tmp_path_factory, raw):
    from benchlib.records.store import RecordsUnreadable, list_runs

    root = tmp_path_factory.mktemp("runs")
    _beside_a_good_run(root)
    odd = Run._start(root / "odd", "odd", "cpu", None, {})
    (odd.path / "records.parquet").write_bytes(raw)
    before = _files(root)
    with pytest.raises(RecordsUnreadable, match="records.parquet"):
        read_records_file(odd.path / "records.parquet")
    runs = list_runs(root).set_index("run_id")
    assert runs.loc["good", "records"] == 1 and "records.parquet" in runs.loc["odd", "problem"]
    assert _files(root) == before


@pytest.mark.slow  # its run's environment asks git for the commit
@SOME
@given(name=st.one_of(st.text(max_size=30), st.sampled_from(["", ".", "..", "/", "latest", "good/..", "../good",
                                                             "good/run.json", "\x00", "a" * 300, "~", "odd/"])))
def test_any_run_name_resolves_to_a_run_or_is_refused_saying_so(tmp_path_factory, name):
    from benchlib.records.store import RecordsUnreadable, resolve_run

    root = tmp_path_factory.mktemp("runs")
    good = _beside_a_good_run(root)
    try:
        found = resolve_run(name, root)
    except (FileNotFoundError, RecordsUnreadable, ValueError) as error:
        assert str(error)
    else:
        assert (found / "run.json").is_file() or (found / "records.parquet").is_file()
    assert resolve_run("good", root) == good.path
