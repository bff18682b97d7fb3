"""Reusable staging buffers, bounded: a refit repeats the same plan, so its staging needs repeat.

Fresh large host buffers cost a page fault per page on first touch (often more than the copy into
them); a pool kept across refits (e.g. by a prepared session) hands the same buffers back. Buffers
are flat uint8 tensors. ``take`` reuses the smallest free buffer of the device that is large enough
(handing out its leading ``nbytes``), so messages of many distinct sizes share buffers instead of
each keeping its own. The free buffers never exceed the most bytes that were ever out at once
(``peak_out``): memory the pool holds is at most twice what the executor's staging needed, never the
sum of every message size a plan has (contract 4, docs/design.md). ``clear()`` frees them.
"""

from __future__ import annotations

import bisect
import weakref

import torch

SLACK = 1 << 20
"""Bytes a reused buffer may exceed a small request by (see ``StagingPool.take``)."""


class StagingPool:
    """Free buffers per device, sorted by size. Not thread safe; one per executing rank."""

    def __init__(self) -> None:
        self._free: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}  # (bytes, seq, buffer)
        self._seq = 0
        self._held = 0
        self.out_bytes = 0
        """Bytes of the buffers handed out and not yet given back."""
        self.peak_out = 0
        """The most bytes ever handed out at once: the bound on what the pool keeps."""

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` on ``device`` (contents undefined); return it with ``give``.

        Reuses the smallest free buffer that fits, unless that one would waste more than
        ``max(nbytes, SLACK)`` bytes (a huge buffer is not tied up by a tiny message)."""
        free = self._free.get(torch.device(device), [])
        at = bisect.bisect_left(free, (nbytes, -1))
        if at < len(free) and free[at][0] <= nbytes + max(nbytes, SLACK):
            self._held -= free[at][0]
            base = free.pop(at)[2]
        else:
            base = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.out_bytes += base.numel()
        self.peak_out = max(self.peak_out, self.out_bytes)
        return base if base.numel() == nbytes else base[:nbytes]

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from ``take`` once nothing reads or writes it any more."""
        base = buffer if buffer._base is None else buffer._base
        self.out_bytes -= base.numel()
        free = self._free.setdefault(base.device, [])
        self._seq += 1
        bisect.insort(free, (base.numel(), self._seq, base))
        self._held += base.numel()
        while self._held > self.peak_out:  # drop the smallest: the largest serve more requests
            smallest = min((f for f in self._free.values() if f), key=lambda f: f[0][0])
            self._held -= smallest.pop(0)[0]

    @property
    def held_bytes(self) -> int:
        """Bytes kept for reuse (at most ``peak_out``)."""
        return self._held

    def clear(self) -> None:
        self._free.clear()
        self._held = 0


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
