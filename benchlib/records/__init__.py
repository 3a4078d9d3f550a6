"""What a run leaves: the metric registry, tidy records and their schema, run metadata, atomic storage
and loading runs back (parquet and JSON; no pickle). The measuring code writes through it; judging
(`benchlib.analysis`) and showing (`benchlib.report`) read it."""

from benchlib.lazy_exports import lazy_exports

# Public names and the module that holds each, imported when first asked for: a process that reads one part (the
# environment's facts, a metric's name) loads no pandas.
_HOMES = {
    "capture_environment": "environment",
    "METRICS": "metrics",
    "Metric": "metrics",
    "MetricError": "metrics",
    "DIMENSIONS": "schema",
    "RECORD_COLUMNS": "schema",
    "SCHEMA_VERSION": "schema",
    "STATUSES": "schema",
    "RecordError": "schema",
    "make_record": "schema",
    "params_json": "schema",
    "records_frame": "schema",
    "status_record": "schema",
    "Run": "store",
    "default_results_root": "places",
    "list_runs": "store",
    "load_records": "store",
    "load_run_info": "store",
    "reference_records": "store",
    "write_json_atomic": "store",
    "write_parquet_atomic": "store",
}

__getattr__ = lazy_exports(__name__, _HOMES)

__all__ = sorted(_HOMES)
