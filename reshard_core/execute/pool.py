"""Reusable staging buffers: a refit repeats the same plan, so its staging sizes repeat exactly.

Fresh large host buffers cost a page fault per page on first touch (often more than the copy into
them); a pool kept across refits (e.g. by a prepared session) hands the same buffers back. Buffers
are flat uint8 tensors, reused only for the same (device, size); ``clear()`` frees them.
"""

from __future__ import annotations

import weakref

import torch


class StagingPool:
    """Free lists of staging buffers by (device, bytes). Not thread safe; one per executing rank."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = {}

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` on ``device`` (contents undefined)."""
        free = self._free.get((torch.device(device), nbytes))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from ``take`` once nothing reads or writes it any more."""
        self._free.setdefault((buffer.device, buffer.numel()), []).append(buffer)

    @property
    def held_bytes(self) -> int:
        """Bytes kept for reuse."""
        return sum(b.numel() for free in self._free.values() for b in free)

    def clear(self) -> None:
        self._free.clear()


_PLAN_POOLS: dict[int, tuple[weakref.ref, StagingPool]] = {}


def pool_for(plan: object) -> StagingPool:
    """The pool kept with ``plan`` while it lives: refits repeat a cached plan, so its staging sizes
    repeat, and the pool hands the same (already touched) buffers back. Freed with the plan."""
    key = id(plan)
    found = _PLAN_POOLS.get(key)
    if found is not None and found[0]() is plan:
        return found[1]
    pool = StagingPool()
    _PLAN_POOLS[key] = (weakref.ref(plan, lambda ref: _forget(key, ref)), pool)
    return pool


def _forget(key: int, ref: weakref.ref) -> None:
    found = _PLAN_POOLS.get(key)
    if found is not None and found[0] is ref:
        del _PLAN_POOLS[key]
