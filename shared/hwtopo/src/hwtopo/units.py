"""Parse and format quantities with units: bytes, bandwidth, durations, FLOP/s.

Specs are written by people, so every quantity accepts either a plain number (already in SI base
units: bytes, bytes/s, seconds, FLOP/s) or a string with a unit ("16GiB", "10Gbps", "25ms",
"1.2TFLOPS"). Errors name the field and show a valid example.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "SpecError",
    "parse_bytes",
    "parse_bandwidth",
    "parse_duration",
    "parse_flops",
    "format_bytes",
    "format_bandwidth",
    "format_duration",
    "format_flops",
]


class SpecError(ValueError):
    """A bad value in a hardware spec.

    ``field`` is the dotted path of the offending field ("" for the whole spec) and ``source`` the
    file it came from (None for an in-memory spec); both lead the message.
    """

    def __init__(self, field: str, message: str, source: str | None = None):
        self.field = field
        self.message = message
        self.source = source
        super().__init__(": ".join(part for part in (source, field, message) if part))


_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_IEC = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

_BYTES_RE = re.compile(rf"^{_NUM}\s*([kKMGTPE]i?)?(B|bytes?)?$")
# bandwidth: bit rates (bps, Kbps, Gbit/s) or byte rates (B/s, MB/s, GiB/s, MBps)
_BW_RE = re.compile(rf"^{_NUM}\s*([kKMGTPE]i?)?(bps|bit/s|b/s|Bps|B/s|bytes/s)$")
_DUR_RE = re.compile(rf"^{_NUM}\s*(ns|us|µs|ms|s|sec|min|h)$")
_FLOPS_RE = re.compile(rf"^{_NUM}\s*([kKMGTPE])?(FLOPS|FLOP/s|flops|flop/s)$")
_DUR = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0}


def _prefix(p: str | None) -> float:
    if not p:
        return 1.0
    return _IEC[p] if p.endswith("i") else _SI[p]


def _number(value: object, field: str, kind: str, example: str) -> float | None:
    """Return a float for numeric input, None for strings, raise for anything else."""
    if isinstance(value, bool):
        raise SpecError(field, f"{value!r} is not a {kind}; use e.g. {example!r}")
    if isinstance(value, (int, float)):
        v = float(value)
        if not math.isfinite(v):
            raise SpecError(field, f"{value!r} is not a finite {kind}; use e.g. {example!r}")
        if v < 0:
            raise SpecError(field, f"{value!r} is negative; a {kind} must be >= 0")
        return v
    if not isinstance(value, str):
        raise SpecError(field, f"{value!r} is not a {kind}; use e.g. {example!r}")
    return None


def _parse(value: object, field: str, kind: str, example: str, regex: re.Pattern, scale) -> float:
    v = _number(value, field, kind, example)
    if v is not None:
        return v
    m = regex.match(str(value).strip())
    if not m:
        raise SpecError(field, f"{value!r} is not a {kind}; use e.g. {example!r}")
    v = float(m.group(1)) * scale(m)
    if not math.isfinite(v):  # "1e400GiB" matches the pattern but overflows to inf
        raise SpecError(field, f"{value!r} is too large to be a finite {kind}; use e.g. {example!r}")
    return v


def parse_bytes(value: object, field: str = "") -> float:
    """'16GiB' -> 17179869184.0; plain numbers are bytes."""
    return _parse(value, field, "size in bytes", "16GiB", _BYTES_RE, lambda m: _prefix(m.group(2)))


def parse_bandwidth(value: object, field: str = "") -> float:
    """Bandwidth in bytes/s: '10Gbps' -> 1.25e9, '2GB/s' -> 2e9; plain numbers are bytes/s."""

    def scale(m: re.Match) -> float:
        unit = m.group(3)
        bits = unit in ("bps", "bit/s", "b/s")
        return _prefix(m.group(2)) / (8.0 if bits else 1.0)

    return _parse(value, field, "bandwidth", "10Gbps", _BW_RE, scale)


def parse_duration(value: object, field: str = "") -> float:
    """Duration in seconds: '25ms' -> 0.025; plain numbers are seconds."""
    return _parse(value, field, "duration", "25ms", _DUR_RE, lambda m: _DUR[m.group(2)])


def parse_flops(value: object, field: str = "") -> float:
    """Compute rate in FLOP/s: '1.2TFLOPS' -> 1.2e12; plain numbers are FLOP/s."""
    return _parse(value, field, "compute rate", "1.2TFLOPS", _FLOPS_RE, lambda m: _SI[m.group(2) or ""])


def _fmt(value: float, base: float, units: list[str], suffix: str) -> str:
    i = 0
    while abs(value) >= base and i < len(units) - 1:
        value /= base
        i += 1
    return f"{value:.3g}{units[i]}{suffix}"


def format_bytes(n: float) -> str:
    """17179869184 -> '16GiB'."""
    return _fmt(float(n), 1024.0, ["", "Ki", "Mi", "Gi", "Ti", "Pi"], "B")


def format_bandwidth(bytes_per_s: float) -> str:
    """Bytes/s as a decimal byte rate: 1.25e9 -> '1.25GB/s'."""
    return _fmt(float(bytes_per_s), 1000.0, ["", "k", "M", "G", "T", "P"], "B/s")


def format_duration(seconds: float) -> str:
    s = float(seconds)
    if s == 0:
        return "0s"
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= f:
            return f"{s / f:.3g}{unit}"
    return f"{s / 1e-9:.3g}ns"


def format_flops(flops: float) -> str:
    return _fmt(float(flops), 1000.0, ["", "k", "M", "G", "T", "P"], "FLOPS")
