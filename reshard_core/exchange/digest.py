"""Holding digests: a cheap check that every rank agrees with the layouts others reported for it.

Only one rank per (tensor, layout) describes it, so the other ranks of that mesh must confirm they
hold the same thing. Each rank sends ``sum(h(fact) for its own facts) mod 2**64``; if every rank
agrees with the table, the sum over ranks equals ``sum(len(mesh) * h(fact))`` over the table's
facts, which every rank computes locally in O(table). A mismatch sends every rank down the (rare)
error path that finds and names the disagreeing tensor and ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from ..layout import Layout
from ..plan.table import LayoutTable
from ..specs import TensorMeta

MOD = 1 << 64


class FactHasher:
    """64-bit hashes of (side, meta, layout) facts, memoising the layout part by object identity."""

    def __init__(self) -> None:
        self._layouts: dict[int, tuple[Layout, bytes]] = {}

    def _layout(self, layout: Layout) -> bytes:
        found = self._layouts.get(id(layout))
        if found is None:
            text = f"{layout.mesh.ranks}|{layout.mesh.shape}|{layout.placements!r}"
            found = self._layouts[id(layout)] = (
                layout,
                hashlib.blake2b(text.encode(), digest_size=16).digest(),
            )
        return found[1]

    def __call__(self, side: str, meta: TensorMeta, layout: Layout) -> int:
        h = hashlib.blake2b(self._layout(layout), digest_size=8)
        h.update(f"{side}|{meta.name}|{tuple(meta.shape)}|{meta.dtype}".encode())
        return int.from_bytes(h.digest(), "little")


def holding_digest(facts: Iterable[tuple[str, TensorMeta, Layout]]) -> int:
    """The digest a rank sends for its own (side, meta, layout) facts."""
    hasher = FactHasher()
    return sum(hasher(side, meta, layout) for side, meta, layout in facts) % MOD


def expected_total(table: LayoutTable) -> int:
    """What the ranks' digests add up to when every rank agrees with ``table``."""
    hasher = FactHasher()
    total = 0
    for e in table.entries:
        for side, layouts in (("src", e.src), ("dst", e.dst)):
            meta = e.source_meta if side == "src" else e.meta
            for layout in layouts:
                total += len(layout.mesh.ranks) * hasher(side, meta, layout)
    return total % MOD
