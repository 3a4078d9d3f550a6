"""Numbers as the tables and lines show them: seconds, counts and bytes (decimal units). Imports nothing,
so the instrument and the records (`benchlib.measure`, `benchlib.records`) both use it."""

from __future__ import annotations


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
