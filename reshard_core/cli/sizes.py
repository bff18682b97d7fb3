"""Byte sizes as users type them on the command line (``64MiB``, ``1.5GB``, ``4096``)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"64MiB"``, ``"1.5GB"``, ``"4096"`` → bytes; ``ValueError`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad byte size {text!r}: use e.g. 4096, 64MiB or 1GB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"bad byte size {text!r}: must be positive")
    return value
