"""Batch assignment: a function of the table alone, so every rank computes the same batches.

Tensors are taken in canonical (sorted-name) order and packed greedily: a tensor joins the
current batch unless that would push the batch's weight over ``max_batch_bytes``, in which case it
opens a new batch; one logical tensor is never split; ``None`` means one batch.

The weight of a tensor is the most bytes one rank can stage for it:
``w = nbytes × ceil(D / S)`` with ``D``/``S`` the number of destination/source copies of each
element. A rank receives each of its destination elements once (≤ ``nbytes``), and the balanced
replica choice (see ``boxes``) makes one source copy serve at most ``ceil(D / S)`` receivers, so it
sends at most ``nbytes × ceil(D / S)``.

**Staging bound (contract 4, docs/design.md).** In every batch, each rank's packed sends total at most
``max_batch_bytes``, and so do its staged receives, except in a batch holding a single tensor
whose weight alone exceeds the budget, where each is at most that tensor's weight. With at least
as many source copies as destination copies (``D ≤ S``, the usual refit) the weight is the
tensor's size, so each of sends and receives stays ≤ ``max(max_batch_bytes, largest tensor)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..layout import Layout, Shard
from .table import LayoutTable


@dataclass(frozen=True)
class Batches:
    """``of[name]`` is the batch of each tensor; ``count`` the number of batches."""

    of: dict[str, int]
    count: int


def copies(layouts: tuple[Layout, ...]) -> int:
    """How many copies of every element a side's layouts hold (replicate mesh dims, all layouts)."""
    return sum(
        prod(s for s, p in zip(lay.mesh.shape, lay.placements, strict=True) if not isinstance(p, Shard))
        for lay in layouts
    )


def tensor_weight(entry) -> int:
    """Upper bound on the bytes one rank stages for ``entry`` (see module docstring)."""
    nbytes = prod(entry.meta.shape) * entry.meta.dtype.itemsize
    src, dst = copies(entry.src), copies(entry.dst)
    return nbytes * max(1, -(-dst // src)) if src else nbytes


def assign_batches(table: LayoutTable, max_batch_bytes: int | None) -> Batches:
    """Greedy batch assignment over the table's canonical order (cached on the table)."""
    if max_batch_bytes is not None and max_batch_bytes <= 0:
        raise ValueError(f"max_batch_bytes must be positive, got {max_batch_bytes}")
    key = ("batches", max_batch_bytes)
    found = table.cache.get(key)
    if found is not None:
        return found
    of: dict[str, int] = {}
    batch, used = 0, 0
    for entry in table.entries:
        if max_batch_bytes is not None:
            w = tensor_weight(entry)
            if used and used + w > max_batch_bytes:
                batch, used = batch + 1, 0
            used += w
        of[entry.name] = batch
    found = table.cache[key] = Batches(of, batch + 1 if of else 1)
    return found
