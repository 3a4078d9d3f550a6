"""The tidy record schema: one row per measured value, validated where it is made.

A record names its benchmark and case, what varies (`dimension`, e.g. engine or strategy) and
its value (`variant`), the device and dtype, a registered metric (`benchlib.records.metrics`) with
its unit, the value, a repeat index and typed parameters (a JSON object).

Validation happens in `make_record` and `records_frame` so that a bad row fails in the
workload that produced it, with the field named, rather than later as a confusing plot.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from benchlib.errors import Refused
from benchlib.records.metrics import METRICS, Metric, MetricError  # noqa: F401  (re-exported)

# Version 2: `dimension` + `variant` (what varies and its value) replace the overloaded `engine`;
# metric names and units checked against METRICS. Version 1 (no version stamp) is read by
# `upgrade_frame`.
SCHEMA_VERSION = 2
SCHEMA_VERSION_KEY = "benchlib.schema_version"  # key in the parquet file's metadata

RECORD_COLUMNS: tuple[str, ...] = (
    "run_id",
    "benchmark",
    "case",
    "dimension",
    "variant",
    "device",
    "dtype",
    "metric",
    "value",
    "unit",
    "repeat",
    "params",
)

# What a record's `variant` may name: pass it to make_record by this keyword (engine="torch",
# strategy="naive", mode="vmap"...); the keyword becomes `dimension`, its value `variant`.
DIMENSIONS: dict[str, str] = {  # the shared one; a benchmark declares its own (`Benchmark(dimensions=...)`)
    "engine": "a gradient engine of benchlib.engines (or one of a workload's own engine adapters)",
}

# One constructor, `status_record`, writes these: a case that ran (ok), failed, or could not run here.
STATUSES = ("ok", "failed", "not_applicable", "not_run")

# Labels that identify a value; each must be a non-empty string. `_record` takes the first six as one
# mapping; make_record takes the named ones and the dimension keyword (see DIMENSIONS).
_RECORD_LABELS = ("benchmark", "case", "dimension", "variant", "device", "dtype")
_NAMED_LABELS = ("benchmark", "case", "device", "dtype")
_LABEL_FIELDS = _RECORD_LABELS + ("metric",)
_REQUIRED_FIELDS = _LABEL_FIELDS + ("value", "unit")
_COLUMN_DTYPES = {name: str for name in RECORD_COLUMNS} | {"value": "float64", "repeat": "int64"}


def arrow_schema():
    """The pyarrow schema records.parquet files are written with (schema_version in its metadata)."""
    import pyarrow as pa

    types = {"value": pa.float64(), "repeat": pa.int64()}
    # value may be NaN ("not measured"), which pyarrow stores as null and reads back as NaN
    return pa.schema([pa.field(name, types.get(name, pa.string()), nullable=name == "value") for name in RECORD_COLUMNS],
                     metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION)})


class RecordError(Refused):
    """A record that does not fit the schema; the message names the field and what is valid."""


def _device_name(device: Any) -> str:
    """Accept a device string or anything with a string `.name` (a benchlib.measure.Device)."""
    name = getattr(device, "name", device)
    if not isinstance(name, str):
        raise RecordError(
            f"device must be a string such as 'cpu' or 'cuda:0' (or a Device), got {device!r}"
        )
    return name


def _dtype_name(dtype: Any) -> str:
    """Normalise NumPy and torch dtypes to one spelling ('float32'), so engines compare."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        import numpy as np

        return np.dtype(dtype).name
    except TypeError:
        raise RecordError(
            f"dtype must be a string such as 'float64' or a NumPy/torch dtype, got {dtype!r}"
        ) from None


def _json_default(value: Any) -> Any:
    """Let NumPy scalars and arrays through json.dumps; refuse anything else by name."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def params_json(params: Mapping[str, Any] | None) -> str:
    """Parameters as a JSON string with sorted keys, so equal parameters compare equal."""
    if params is None:
        return "{}"
    if not isinstance(params, Mapping):
        raise RecordError(f"params must be a dict of JSON-able values or None, got {params!r}")
    try:
        return json.dumps(dict(params), sort_keys=True, default=_json_default)
    except (TypeError, ValueError) as error:
        raise RecordError(f"params must hold JSON-able values (numbers, strings, lists, dicts): {error}") from None


def _value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RecordError(
            f"value must be a real number (int, float or NumPy scalar; NaN for 'not measured'), "
            f"got {type(value).__name__} {value!r}"
        )
    return float(value)


def _repeat(repeat: Any) -> int:
    if isinstance(repeat, bool) or not isinstance(repeat, numbers.Integral) or repeat < 0:
        raise RecordError(f"repeat must be a non-negative integer, got {repeat!r}")
    return int(repeat)


def _variant(variant: Mapping[str, Any]) -> tuple[str, str]:
    """The one `dimension=name` keyword of make_record, as (dimension, variant)."""
    if len(variant) != 1 or next(iter(variant)) not in DIMENSIONS:
        given = ", ".join(f"{key}={value!r}" for key, value in variant.items()) or "none"
        raise RecordError(f"a record names what varies with exactly one of {', '.join(f'{d}=' for d in DIMENSIONS)} "
                          f"(got {given}); declare a new one with its benchmark (Benchmark(dimensions={{name: meaning}}))")
    (dimension, value), = variant.items()
    return dimension, value


def _labels(labels: Mapping[str, Any]) -> dict[str, Any]:
    """make_record's label keywords as a record's labels: the named ones, and the dimension keyword
    as `dimension` and `variant`. A missing label is named here rather than as a TypeError."""
    missing = [name for name in _NAMED_LABELS if name not in labels]
    if missing:
        unknown = [key for key in labels if key not in _NAMED_LABELS and key not in DIMENSIONS]
        also = f" (unknown: {', '.join(f'{key}=' for key in unknown)})" if unknown else ""
        raise RecordError(f"a record needs {', '.join(f'{name}=' for name in missing)}{also}; "
                          f"make_record takes {', '.join(f'{name}=' for name in _NAMED_LABELS)} and one dimension")
    dimension, variant = _variant({key: value for key, value in labels.items() if key not in _NAMED_LABELS})
    return {**{name: labels[name] for name in _NAMED_LABELS}, "dimension": dimension, "variant": variant}


def make_record(
    *,
    metric: str,
    value: float,
    unit: str | None = None,
    repeat: int = 0,
    params: Mapping[str, Any] | None = None,
    **labels: Any,
) -> dict[str, Any]:
    """One tidy row; `run_id` stays empty until `Run.save_records` fills it.

    `labels` are ``benchmark=``, ``case=``, ``device=``, ``dtype=`` and what varies, one keyword such
    as ``engine="torch"`` or ``strategy="naive"`` (see DIMENSIONS): taken as keywords so that a
    workload passes its labels dict through.
    `metric` must be registered in METRICS; `unit` defaults to its unit and, if given, must match.
    """
    return _record(_labels(labels), metric=metric, value=value, unit=unit, repeat=repeat, params=params)


def status_record(*, status: str, message: str = "", params: Mapping[str, Any] | None = None,
                  **labels: Any) -> dict[str, Any]:
    """The row that says how a case ended: `ok`, `failed` (message: the error), `not_applicable`
    (message: why it cannot run here) or `not_run` (message: why not, e.g. the budget ran out). Its metric is the status, its value 1; `labels` as make_record's."""
    if status not in STATUSES:
        raise RecordError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    return make_record(metric=status, value=1.0, params={**(params or {}), "status": status, "message": message},
                       **labels)


def _record(labels: Mapping[str, Any], *, metric, value, unit, repeat, params) -> dict:
    """A validated row; `labels` holds benchmark, case, dimension, variant, device and dtype."""
    record = {
        "run_id": "",
        "benchmark": labels["benchmark"],
        "case": labels["case"],
        "dimension": labels["dimension"],
        "variant": labels["variant"],
        "device": _device_name(labels["device"]),
        "dtype": _dtype_name(labels["dtype"]),
        "metric": metric,
        "value": _value(value),
        "unit": unit,
        "repeat": _repeat(repeat),
        "params": params_json(params),
    }
    for field in _LABEL_FIELDS:
        if not isinstance(record[field], str) or not record[field]:
            raise RecordError(f"{field} must be a non-empty string, got {record[field]!r}")
    if record["dimension"] not in DIMENSIONS:
        raise RecordError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {record['dimension']!r}")
    try:
        record["unit"] = METRICS.unit_of(metric, unit)
    except MetricError as error:
        raise RecordError(str(error)) from None
    return record


def _validated_row(row: Mapping[str, Any], index: int) -> dict[str, Any]:
    missing = [field for field in _REQUIRED_FIELDS if field not in row]
    if missing:
        raise RecordError(
            f"record {index} is missing {', '.join(missing)}; "
            f"a record has {', '.join(RECORD_COLUMNS)} (make_record builds one)"
        )
    unknown = sorted(set(row) - set(RECORD_COLUMNS))
    if unknown:
        raise RecordError(
            f"record {index} has unknown field(s) {', '.join(unknown)}; "
            f"valid fields: {', '.join(RECORD_COLUMNS)} (put anything else in params)"
        )
    params = row.get("params")
    try:
        record = _record(
            {name: row[name] for name in _RECORD_LABELS},
            metric=row["metric"],
            value=row["value"],
            unit=row["unit"],
            repeat=row.get("repeat", 0),
            params=json.loads(params) if isinstance(params, str) else params,
        )
    except RecordError as error:
        raise RecordError(f"record {index}: {error}") from None
    except json.JSONDecodeError as error:
        raise RecordError(f"record {index}: params is not valid JSON: {error}") from None
    run_id = row.get("run_id", "")
    record["run_id"] = "" if run_id is None or (isinstance(run_id, float) and math.isnan(run_id)) else str(run_id)
    return record


def empty_records_frame() -> pd.DataFrame:
    """A frame with the schema's columns and dtypes and no rows."""
    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in _COLUMN_DTYPES.items()})


def records_frame(records: Iterable[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Rows (dicts, or a frame of them) to a validated DataFrame with the schema's columns and dtypes."""
    if isinstance(records, pd.DataFrame):
        rows = records.to_dict("records")
    elif isinstance(records, Mapping):
        raise RecordError("records_frame takes a list of records, got a single record (wrap it in a list)")
    else:
        rows = list(records)
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise RecordError(f"record {index} is a {type(row).__name__}, not a dict (make_record builds one)")
    validated = [_validated_row(row, index) for index, row in enumerate(rows)]
    if not validated:
        return empty_records_frame()
    frame = pd.DataFrame(validated, columns=list(RECORD_COLUMNS))
    return frame.astype(_COLUMN_DTYPES)


# What version 1's overloaded `engine` column held, per benchmark, where it was not an engine:
# (dimension of the benchmark's other rows, {v1 value: (dimension, today's variant)}).
_V1_VARIANTS = {
    "calibration": ("library", {}),
    "mnist_ensembles": ("strategy", {"sequential": ("mode", "sequential"), "threads": ("mode", "threads"),
                                     "vmap": ("mode", "vmap"), "python-gc": ("collector", "python-gc"),
                                     "floor": ("bound", "flop_floor")}),
    "identical_closures": ("engine", {"tracker": ("tracker", "memray")}),
}


def _v1_labels(benchmark: str, engine: str) -> tuple[str, str]:
    dimension, special = _V1_VARIANTS.get(benchmark, ("engine", {}))
    return special.get(engine, (dimension, engine))


def upgrade_frame(frame: pd.DataFrame, version: int) -> pd.DataFrame:
    """Records written under schema `version` in today's columns, or RecordError saying why not.

    Version 1 had one `engine` column for whatever varied: each row gets the dimension and variant
    today's workloads give it (strategy, mode, library...; `engine` where it was an engine), so an
    old run compares with a new one key by key.
    """
    if version == SCHEMA_VERSION:
        return frame
    if version == 1:
        if "engine" not in frame.columns or "benchmark" not in frame.columns:
            raise RecordError("schema version 1 records need `benchmark` and `engine` columns, and these lack one")
        labels = [_v1_labels(b, e) for b, e in zip(frame["benchmark"], frame["engine"])]
        return frame.drop(columns="engine").assign(dimension=[d for d, _ in labels], variant=[v for _, v in labels])
    raise RecordError(f"records of schema version {version}; this benchlib reads versions 1 to {SCHEMA_VERSION}"
                      + (" (written by a newer benchlib: update it)" if version > SCHEMA_VERSION else ""))


def conform(frame: pd.DataFrame) -> pd.DataFrame:
    """Give a frame read back from parquet the schema's column order and dtypes."""
    missing = [name for name in RECORD_COLUMNS if name not in frame.columns]
    if missing:
        raise RecordError(f"records are missing column(s) {', '.join(missing)}; expected {', '.join(RECORD_COLUMNS)}")
    return frame[list(RECORD_COLUMNS)].astype(_COLUMN_DTYPES).reset_index(drop=True)
