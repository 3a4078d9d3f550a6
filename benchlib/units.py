"""Numbers as the tables and lines show them: seconds, counts and bytes (decimal units), and sizes as people write
them ("80 GiB", `parse_bytes`). Imports nothing but `benchlib.errors`, so the instrument, the records and every
command's refusals (`benchlib.measure`, `benchlib.records`, fit's `--memory`, the gate's limits) use it."""

from __future__ import annotations

import math
import re
from typing import Any

from benchlib.errors import Refused

BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_QUANTITY = re.compile(r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def _sig4(value: float) -> str:
    """Four significant digits, trailing zeros kept (812.0, 1.331, 10.69)."""
    text = f"{value:#.4g}"
    return text.rstrip(".") if "e" not in text else text


def format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("μs", 1e-6)):
        if abs(seconds) >= 0.1 * scale:
            value = seconds / scale
            return f"{value:.1f} {unit}" if value >= 1e4 else f"{_sig4(value)} {unit}"
    return f"{_sig4(seconds / 1e-9)} ns"


def format_count(count: int) -> str:
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{_sig4(count / scale)} {suffix}"
    return str(count)


def format_bytes(nbytes: int) -> str:
    """Bytes in decimal units (kB, MB, GB, TB: powers of 1000), the one byte unit of every table and figure."""
    sign = "-" if nbytes < 0 else ""
    nbytes = abs(nbytes)
    if nbytes < 1000:
        return f"{sign}{nbytes} {'byte' if nbytes == 1 else 'bytes'}"
    for unit in ("kB", "MB", "GB", "TB"):
        nbytes /= 1000
        if nbytes < 1000 or unit == "TB":
            return f"{sign}{_sig4(nbytes)} {unit}"


def unit_scale(value: float, unit: str) -> tuple[float, str]:
    """The factor and name to show values near `value` in: bytes in kB/MB/GB, seconds in ms or µs."""
    scales = {"B": ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")),
              "s": ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))}.get(unit)
    if scales is None:
        return 1.0, "" if unit == "count" else unit
    return next((scale for scale in scales if abs(value) >= scale[0]), scales[-1])


def parse_bytes(value: Any) -> int:
    """A byte limit: a number of bytes, or text with a unit ("64 MiB", "0.5 GB", "800kB")."""
    valid = "a number of bytes, or a number with a unit: B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB " \
            "(powers of 1024), e.g. '64 MiB' or '0.5 GB'"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
        return int(value)
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in BYTE_UNITS):
        raise Refused(f"{value!r} is not a memory size; valid: {valid}")
    size = float(match.group(1)) * BYTE_UNITS[unit or "b"]
    if not math.isfinite(size):
        raise Refused(f"{value!r} is not a finite memory size; valid: {valid}")
    return int(size)
