"""Tidy records, run metadata, atomic storage and loading runs back (parquet and JSON; no pickle)."""

from benchlib.results.environment import capture_environment
from benchlib.results.records import RECORD_COLUMNS, RecordError, make_record, params_json, records_frame
from benchlib.results.store import (
    Run,
    default_results_root,
    list_runs,
    load_records,
    load_run_info,
    reference_records,
    write_json_atomic,
    write_parquet_atomic,
)

__all__ = [
    "RECORD_COLUMNS",
    "RecordError",
    "Run",
    "capture_environment",
    "default_results_root",
    "list_runs",
    "load_records",
    "load_run_info",
    "make_record",
    "params_json",
    "records_frame",
    "reference_records",
    "write_json_atomic",
    "write_parquet_atomic",
]
