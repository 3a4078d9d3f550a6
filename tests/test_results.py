"""benchlib.records: record validation, atomic writes, run directories, run.json, loading runs."""

import importlib.metadata
import json
import os
import shutil
import platform
import re
from datetime import datetime, timezone

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io
import pytest
import torch

from benchlib.report.figure_files import save_figure
from benchlib.records import (
    METRICS,
    RECORD_COLUMNS,
    SCHEMA_VERSION,
    RecordError,
    Run,
    capture_environment,
    default_results_root,
    list_runs,
    load_records,
    load_run_info,
    make_record,
    records_frame,
    reference_records,
    status_record,
    write_parquet_atomic,
)
from benchlib.records.store import RecordsUnreadable, new_run_dir


def record(**overrides):
    fields = dict(
        benchmark="dot_chain", case="D=10", engine="torch", device="cpu", dtype="float64",
        metric="peak_bytes", value=1024, unit="B", repeat=0, params={"depth": 3, "D": 10},
    )
    fields.update(overrides)
    return make_record(**fields)


def test_make_record_normalises_labels_and_params():
    row = record(dtype=torch.float32, value=np.int64(7), params={"z": np.int64(1), "a": [1, 2]})
    assert row["dtype"] == "float32"
    assert record(dtype=np.float64)["dtype"] == "float64"
    assert row["value"] == 7.0 and isinstance(row["value"], float)
    assert row["params"] == '{"a": [1, 2], "z": 1}'
    assert row["run_id"] == ""
    assert list(row) == list(RECORD_COLUMNS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"value": "12"}, "value must be a real number"),
        ({"value": True}, "value must be a real number"),
        ({"repeat": -1}, "repeat must be a non-negative integer"),
        ({"engine": ""}, "variant must be a non-empty string"),
        ({"params": {"f": object()}}, "params must hold JSON-able values"),
        ({"device": 3}, "device must be a string"),
    ],
)
def test_make_record_rejects_bad_fields(overrides, message):
    with pytest.raises(RecordError, match=message):
        record(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"metric": "peak_byte"}, "unknown metric 'peak_byte': declare it with its benchmark"),
        ({"unit": "s"}, "metric 'peak_bytes' is in 'B', got unit 's'"),
        ({"strategy": "naive"}, "a record names what varies with exactly one of engine="),
    ],
)
def test_make_record_checks_metric_registry_and_one_varying_dimension(overrides, message):
    with pytest.raises(RecordError, match=re.escape(message)):
        record(**overrides)


def test_make_record_names_a_missing_label_and_an_unknown_keyword():
    with pytest.raises(RecordError, match=re.escape("a record needs case= (unknown: cse=)")):
        make_record(benchmark="b", cse="c", engine="torch", device="cpu", dtype="float32", metric="step_time",
                    value=0.1)


def test_the_varying_dimension_is_named_by_its_keyword_and_units_come_from_the_registry():

    row = make_record(benchmark="mnist_ensembles", case="c", strategy="naive", device="cpu", dtype="float32",
                      metric="step_time", value=0.1)
    assert (row["dimension"], row["variant"], row["unit"]) == ("strategy", "naive", "s")
    assert METRICS["step_time"].kind == "time"


def test_status_record_is_the_one_way_to_say_how_a_case_ended():
    row = status_record(status="failed", message="boom", benchmark="b", case="c", engine="torch", device="cpu",
                        dtype="float32", params={"n": 1})
    assert (row["metric"], row["value"], json.loads(row["params"])) == ("failed", 1.0, {"n": 1, "status": "failed",
                                                                                          "message": "boom"})
    with pytest.raises(RecordError, match="status must be one of ok, failed, not_applicable"):
        status_record(status="broken", benchmark="b", case="c", engine="torch", device="cpu", dtype="float32")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_runs_stamp_the_schema_version_in_run_json_and_parquet_metadata(tmp_path):
    import pyarrow.parquet as pq

    run = Run.open(tmp_path / "run-v", device="cpu")
    run.save_records([record()], "dot_chain")
    assert load_run_info(run.path)["schema_version"] == SCHEMA_VERSION
    for path in (run.path / "records.parquet", run.path / "records" / "dot_chain.parquet"):
        schema = pq.read_schema(path)
        assert schema.metadata[b"benchlib.schema_version"] == str(SCHEMA_VERSION).encode()
        assert schema.field("value").type == "double" and schema.field("repeat").type == "int64"


def test_version_1_records_load_with_engine_as_their_dimension_and_unknown_versions_say_why(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = records_frame([record()]).rename(columns={"variant": "engine"}).drop(columns="dimension")
    (tmp_path / "v1").mkdir()
    old.to_parquet(tmp_path / "v1" / "records.parquet", index=False)
    loaded = load_records(tmp_path / "v1")
    assert list(loaded.columns) == list(RECORD_COLUMNS)
    assert (loaded["dimension"].iloc[0], loaded["variant"].iloc[0]) == ("engine", "torch")
    (tmp_path / "v9").mkdir()
    table = pa.Table.from_pandas(records_frame([record()]), preserve_index=False)
    pq.write_table(table.replace_schema_metadata({"benchlib.schema_version": "9"}), tmp_path / "v9" / "records.parquet")
    with pytest.raises(RecordsUnreadable, match="schema version 9; this benchlib reads versions 1 to 2 \\(written by a newer"):
        load_records(tmp_path / "v9")


def test_committed_reference_run_still_loads_with_todays_dimensions():
    loaded = reference_records("dot_chain", device="cpu")
    assert loaded is not None and set(loaded[1]["dimension"]) == {"engine"} and "manual" in set(loaded[1]["variant"])
    ensembles = reference_records("mnist_ensembles", device="cpu")[1]
    dimensions = dict(zip(ensembles["variant"], ensembles["dimension"]))
    assert (dimensions["naive"], dimensions["vmap"], dimensions["python-gc"], dimensions["flop_floor"]) == (
        "strategy", "mode", "collector", "bound")
    assert set(reference_records("calibration", device="cpu")[1]["dimension"]) == {"library"}
    gpu = reference_records("dot_chain", device="cuda:0")  # the GPU's own reference, never the CPU's
    assert gpu is not None and gpu[0].endswith("-cuda-0") and set(gpu[1]["device"]) == {"cuda:0"}


def test_records_frame_names_missing_and_unknown_fields():
    good = record()
    missing = {key: value for key, value in good.items() if key != "value"}
    with pytest.raises(RecordError, match=r"record 1 is missing value"):
        records_frame([good, missing])
    with pytest.raises(RecordError, match=r"unknown field\(s\) seconds"):
        records_frame([{**good, "seconds": 1.0}])


def test_records_frame_schema_and_empty_frame():
    frame = records_frame([record(repeat=0, value=1.5), record(repeat=1, value=2)])
    assert list(frame.columns) == list(RECORD_COLUMNS)
    assert frame["value"].dtype == np.float64 and frame["repeat"].dtype == np.int64
    assert frame["value"].tolist() == [1.5, 2.0]
    empty = records_frame([])
    assert list(empty.columns) == list(RECORD_COLUMNS) and empty.empty


def test_parquet_round_trip_keeps_values_and_dtypes(tmp_path):
    frame = records_frame([record(value=v, repeat=i, params={"i": i}) for i, v in enumerate([0.5, np.nan, 3e9])])
    path = write_parquet_atomic(frame, tmp_path / "records.parquet")
    back = pd.read_parquet(path)
    pd.testing.assert_frame_equal(back, frame)
    assert os.listdir(tmp_path) == ["records.parquet"]


def test_failed_write_keeps_previous_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "records.parquet"
    before = records_frame([record(value=1)])
    write_parquet_atomic(before, path)

    def write_half_then_fail(self, target, **kwargs):
        with open(target, "wb") as handle:
            handle.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_parquet_atomic(records_frame([record(value=2)]), path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["records.parquet"]
    pd.testing.assert_frame_equal(pd.read_parquet(path), before)


@pytest.mark.slow  # its run's environment asks git for the commit
def test_run_saves_records_per_benchmark_and_merged(tmp_path):
    run = Run.open(tmp_path / "run-a", device="cpu")
    run.save_records([record(benchmark="dot_chain", value=1), record(benchmark="dot_chain", value=2, repeat=1)], "dot_chain")
    run.save_records([record(benchmark="rnn_fanout", value=3)], "rnn_fanout")
    run.save_records([record(benchmark="dot_chain", value=9)], "dot_chain")  # replaces the earlier dot_chain rows

    assert sorted(os.listdir(run.path / "records")) == ["dot_chain.parquet", "rnn_fanout.parquet"]
    merged = load_records(run.path)
    assert set(merged["run_id"]) == {"run-a"}
    assert sorted(zip(merged["benchmark"], merged["value"])) == [("dot_chain", 9.0), ("rnn_fanout", 3.0)]
    with pytest.raises(ValueError, match="rows of benchmark\\(s\\) rnn_fanout"):
        run.save_records([record(benchmark="rnn_fanout")], "dot_chain")
    with pytest.raises(ValueError, match="names a file"):
        run.save_records([record()], "../escape")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_save_figure_writes_html_json_and_one_plotly_bundle(tmp_path):
    run = Run.open(tmp_path / "run-f")
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    html = save_figure(run, fig, "bars")
    save_figure(run, fig, "bars_again")
    figures = run.path / "figures"
    assert sorted(os.listdir(figures)) == ["bars.html", "bars.json", "bars_again.html", "bars_again.json", "plotly.min.js"]
    assert 'src="plotly.min.js"' in html.read_text()
    reloaded = plotly.io.from_json((figures / "bars.json").read_text())
    assert list(reloaded.data[0].y) == [1, 2]
    # a second run beside it shares the one copy of plotly.js on disk (a hard link), and each stays whole
    other = Run.open(tmp_path / "run-g")
    save_figure(other, fig, "bars")
    assert os.path.samefile(other.path / "figures" / "plotly.min.js", figures / "plotly.min.js")
    assert (figures / "plotly.min.js").stat().st_nlink == 2 and sorted(os.listdir(tmp_path)) == ["run-f", "run-g"]
    shutil.rmtree(run.path)  # deleting the first run leaves the second's figures whole
    assert (other.path / "figures" / "plotly.min.js").read_text().startswith("/**")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_save_table_writes_a_parquet_under_tables_and_refuses_unsafe_names(tmp_path):
    run = Run.open(tmp_path / "run-t")
    table = pd.DataFrame({"engine": ["manual", "torch"], "t_s": [0.0, 0.002], "bytes": [0, 4096], "phase": ["", "forward"]})
    path = run.save_table(table, "dot_chain_timelines")
    assert path == run.path / "tables" / "dot_chain_timelines.parquet"
    pd.testing.assert_frame_equal(pd.read_parquet(path), table)
    assert os.listdir(run.path / "tables") == ["dot_chain_timelines.parquet"]  # no temp file left
    with pytest.raises(ValueError, match="names a file"):
        run.save_table(table, "../escape")
    with pytest.raises(TypeError, match="DataFrame"):
        run.save_table(table.to_dict(), "as_dict")


@pytest.mark.slow  # its run's environment asks git for the commit
def test_capture_environment_fields(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    env = capture_environment("cpu", allocator_policy="mmap-128k")
    assert env["python"]["version"] == platform.python_version()
    assert env["packages"]["torch"] == importlib.metadata.version("torch")  # PyPI's CUDA builds: no +cu tag there
    assert env["packages"]["numpy"] == np.__version__
    assert "autograd" in env["packages"]
    assert env["cpu"]["logical_cores"] == os.cpu_count() and env["cpu"]["model"]
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["gpu"]["available"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in env["gpu"]["note"]
    assert env["allocator"]["env"]["MALLOC_ARENA_MAX"] == "2"
    assert env["allocator"]["isolation_default_policy"] == "mmap-128k"
    git = env["git"]
    assert (re.fullmatch(r"[0-9a-f]{40}", git["commit"]) and isinstance(git["dirty"], bool)) or git["note"]
    json.dumps(env)  # run.json must hold it


@pytest.mark.slow  # its run's environment asks git for the commit
def test_run_open_empty_creates_run_dir_with_run_json(results_root):
    run = Run.open("", device="cpu")
    assert run.path.parent == results_root
    assert re.fullmatch(r"\d{8}-\d{6}-[a-z0-9-]+-cpu", run.run_id)
    info = load_run_info(run.run_id)
    assert info["run_id"] == run.run_id and info["device"] == "cpu"
    assert info["started_at"] and info["environment"]["python"]["executable"]
    # Reopening (as a notebook under the runner does) reads run.json, never rewrites it.
    before = (run.path / "run.json").read_bytes()
    assert Run.open(run.path).run_id == run.run_id
    assert (run.path / "run.json").read_bytes() == before


def test_run_ids_are_unique(tmp_path):
    when = datetime(2026, 11, 21, 7, 15, tzinfo=timezone.utc)
    first = new_run_dir(tmp_path, "cuda:0", when)
    second = new_run_dir(tmp_path, "cuda:0", when)
    assert first.name.startswith("20261121-071500-") and first.name.endswith("-cuda-0")
    assert second.name == first.name + "-2"


@pytest.mark.slow  # its run's environment asks git for the commit
def test_list_runs_and_loading_by_id_or_path(results_root):
    first = Run.open("")
    first.save_records([record(value=1), record(value=2, repeat=1)], "dot_chain")
    first.record_notebook("dot_chain", status="failed", error="ValueError: x")
    second = Run.open("")
    runs = list_runs()
    assert runs["run_id"].tolist() == [first.run_id, second.run_id]
    assert runs["records"].tolist() == [2, 0] and runs["failed"].tolist() == [1, 0]
    assert load_records(first.run_id)["value"].tolist() == [1.0, 2.0]
    assert load_records(str(first.path)).equals(load_records(first.run_id))
    assert load_records(second.run_id).empty
    assert load_run_info(first.path)["notebooks"]["dot_chain"]["status"] == "failed"
    with pytest.raises(FileNotFoundError, match=f"known runs in .*{first.run_id}"):
        load_records("no-such-run")


def test_default_results_root_walks_up_to_the_project(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.delenv("BENCHLIB_RESULTS")
    monkeypatch.chdir(tmp_path / "notebooks")
    assert default_results_root() == tmp_path / "results"


@pytest.mark.slow  # its run's environment asks git for the commit
def test_reference_records_come_from_the_newest_committed_reference_run_that_holds_them(tmp_path):
    from benchlib.records import reference_records

    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "notebooks").mkdir()
    for run_id, value in (("20260101-000000-a-cpu", 1.0), ("20260102-000000-a-cpu", 2.0)):
        made = Run.create(tmp_path / "results" / "reference", "cpu")
        made.path.rename(made.path.parent / run_id)
        reference = Run(made.path.parent / run_id, {**made.info, "run_id": run_id})
        reference.save_records([make_record(benchmark="b", case="c", engine="e", device="cpu", dtype="float64",
                                            metric="peak_bytes", value=value, unit="B")], "b")
    run_id, records = reference_records("b", project=tmp_path)
    assert run_id == "20260102-000000-a-cpu" and records["value"].tolist() == [2.0]
    assert reference_records("b", project=tmp_path, device="cuda:0") is None  # no run on that kind of device
    assert reference_records("other", project=tmp_path) is None
