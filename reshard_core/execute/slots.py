"""Byte layout of a packed message: one slot per wire tensor, each aligned to its dtype's item size."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Slot:
    """Where one wire tensor sits in a packed uint8 message."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @cached_property  # read per message per refit; a frozen dataclass keeps it in its __dict__
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def layout_slots(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Slot], int]:
    """Slots for ``(shape, dtype)`` specs in order, and the message size in bytes.

    Each offset is rounded up to its dtype's item size so the slot can be viewed as that dtype;
    sender and receiver derive the same layout from the same specs.
    """
    slots, offset = [], 0
    for shape, dtype in specs:
        size = _itemsize(dtype)
        offset = -(-offset // size) * size
        slot = Slot(offset, tuple(shape), dtype)
        slots.append(slot)
        offset += slot.nbytes
    return slots, offset


def slot_view(message: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The typed, shaped view of ``slot`` inside the flat uint8 ``message``."""
    return message[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
