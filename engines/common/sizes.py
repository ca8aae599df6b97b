"""Byte sizes as users write them (`6MiB`, `40GB`, `512k`... ) and as reports print them. No torch."""

from __future__ import annotations

import re

from engines.base import EngineError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,  # bare letters: binary, as `ls -h` and torch print them
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int, what: str = "size") -> int:
    """'6MiB' -> 6291456, '40GB' -> 40000000000, '1.5GiB', '4096' (bytes); ints pass through."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise EngineError(
                f"{what}: cannot read {text!r} as a size; write a number with a unit, e.g. 6MiB, 512KiB, 40GB"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise EngineError(f"{what} must be positive, got {text!r}")
    return value


def format_size(nbytes: float) -> str:
    """Binary units with three significant digits: 6291456 -> '6.00 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}" if nbytes / scale >= 100 else f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
