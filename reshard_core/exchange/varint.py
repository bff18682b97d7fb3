"""Unsigned LEB128 varints: encode from Python ints, decode a whole buffer at once with torch."""

from __future__ import annotations

import torch


def write(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as a varint."""
    if value < 0:
        raise ValueError(f"varints are unsigned, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def zigzag(value: int) -> int:
    """Signed -> unsigned (0, -1, 1, -2, … -> 0, 1, 2, 3, …)."""
    return value * 2 if value >= 0 else -value * 2 - 1


def unzigzag(value: int) -> int:
    return value >> 1 if not value & 1 else -((value + 1) >> 1)


def decode_all(data: bytes) -> list[int]:
    """Every varint in ``data`` (which must hold whole varints only), vectorised."""
    if not data:
        return []
    b = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    ends = b < 0x80
    if not bool(ends[-1]):
        raise ValueError("truncated varint at the end of the buffer")
    starts = torch.ones_like(ends)
    starts[1:] = ends[:-1]
    group = torch.cumsum(starts, 0) - 1  # varint index of every byte
    positions = torch.arange(b.numel(), dtype=torch.int64)
    shift = 7 * (positions - positions[starts][group])
    if bool((shift > 56).any()):
        raise ValueError("varint wider than 63 bits")
    values = torch.zeros(int(ends.sum()), dtype=torch.int64).index_add_(0, group, (b & 0x7F) << shift)
    return values.tolist()
