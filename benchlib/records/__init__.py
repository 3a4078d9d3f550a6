"""What a run leaves: the metric registry, tidy records and their schema, run metadata, atomic storage
and loading runs back (parquet and JSON; no pickle). The measuring code writes through it; judging
(`benchlib.analysis`) and showing (`benchlib.report`) read it."""

from benchlib.records.environment import capture_environment
from benchlib.records.metrics import METRICS, Metric, MetricError
from benchlib.records.schema import (DIMENSIONS, RECORD_COLUMNS, SCHEMA_VERSION, STATUSES, RecordError, make_record,
                                      params_json, records_frame, status_record)
from benchlib.records.store import (
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
    "DIMENSIONS",
    "METRICS",
    "Metric",
    "MetricError",
    "RECORD_COLUMNS",
    "SCHEMA_VERSION",
    "STATUSES",
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
    "status_record",
    "write_json_atomic",
    "write_parquet_atomic",
]
