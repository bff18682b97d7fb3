"""Plan cache: repeated refits with unchanged layouts skip validation and planning.

The key is a fingerprint of both sides of the layout table (names, shapes, dtypes, every layout's
mesh ranks, mesh shape and placements) plus the rank, the ``PlanOptions`` and a caller-supplied
``group`` key (e.g. the process group's ranks and backend). Any change of shape, layout, option or
group changes the key, so a stale plan is never reused.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from ..layout import Layout
from .ops import RankPlan
from .plan_options import PlanOptions
from .rank import plan_rank
from .table import LayoutTable
from .validate import normalize_options

MAX_ENTRIES = 64
_cache: OrderedDict[tuple, RankPlan] = OrderedDict()


def _layout_bytes(layout: Layout, memo: dict[int, bytes]) -> bytes:
    found = memo.get(id(layout))
    if found is None:
        text = f"{layout.mesh.ranks}|{layout.mesh.shape}|{layout.placements!r}"
        found = memo[id(layout)] = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return found


def table_fingerprint(table: LayoutTable) -> str:
    """A hex digest of everything in ``table`` that shapes a plan (cached on the table)."""
    found = table.cache.get("fingerprint")
    if found is None:
        h = hashlib.blake2b(digest_size=32)
        memo: dict[int, bytes] = {}
        for e in table.entries:
            h.update(f"{e.name}|{tuple(e.meta.shape)}|{e.meta.dtype}|{e.src_name}|".encode())
            if e.src_meta is not None:
                h.update(f"{tuple(e.src_meta.shape)}|{e.src_meta.dtype}|".encode())
            for side in (e.src, e.dst):
                h.update(len(side).to_bytes(4, "little"))
                for layout in side:
                    h.update(_layout_bytes(layout, memo))
        found = table.cache["fingerprint"] = h.hexdigest()
    return found


def plan_cache_key(table: LayoutTable, rank: int, options: PlanOptions, group: Hashable = None) -> tuple:
    """The cache key of ``plan_rank(table, rank, options)`` within process group ``group``."""
    o = options
    return (
        table_fingerprint(table),
        rank,
        o.max_batch_bytes,
        *normalize_options(o.ignore, o.tied),
        group,
        o.cast,
    )


def cached_plan_rank(
    table: LayoutTable,
    rank: int,
    options: PlanOptions | None = None,
    *,
    group: Hashable = None,
    **choices: Any,
) -> tuple[RankPlan, bool]:
    """``(plan, hit)``: the cached plan for this key, or a fresh ``plan_rank`` stored under it.
    ``options`` and ``choices`` as for ``plan_rank``."""
    o = PlanOptions.of(options, **choices)
    key = plan_cache_key(table, rank, o, group)
    found = _cache.get(key)
    if found is not None:
        _cache.move_to_end(key)
        return found, True
    plan = plan_rank(table, rank, o)
    _cache[key] = plan
    while len(_cache) > MAX_ENTRIES:
        _cache.popitem(last=False)
    return plan, False


def clear_plan_cache() -> None:
    """Forget every cached plan."""
    _cache.clear()
