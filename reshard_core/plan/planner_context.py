"""What a per-tensor planner (``reshard_plan_tensor`` hook) receives besides the entry and rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import IndexCache
from .table import LayoutTable


@dataclass
class PlanContext:
    """The (validated) table being planned and the indexes derived from it.

    One context serves every rank planned from ``table``, so indexes built for one rank are reused
    when the same process plans another (offline simulation).
    """

    table: LayoutTable
    index: IndexCache = field(default_factory=IndexCache)


def context_for(table: LayoutTable) -> PlanContext:
    """The table's shared context (created on first use, kept in ``table.cache``)."""
    ctx = table.cache.get("plan_context")
    if ctx is None:
        ctx = table.cache["plan_context"] = PlanContext(table)
    return ctx
