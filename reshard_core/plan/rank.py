"""``plan_rank``: the whole plan of one rank, a pure function of (layout table, rank, options)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .batching import assign_batches
from .ops import RankPlan, TransferOp
from .plan_options import PlanOptions
from .planner_context import PlanContext, context_for
from .table import LayoutTable, TableEntry
from .validate import validate_table

TensorPlanner = Callable[[TableEntry, int, PlanContext], list[TransferOp]]


def tensor_planner() -> TensorPlanner:
    """The per-tensor planner: the ``reshard_plan_tensor`` hook (plugins first, the built-in box
    planner as ``trylast`` fallback)."""
    from ..plugins import get_plugin_manager  # imported here: the planner itself needs no plugins
    from .boxes import plan_tensor

    hook = get_plugin_manager().hook.reshard_plan_tensor

    def plan(entry: TableEntry, rank: int, context: PlanContext) -> list[TransferOp]:
        result = hook(entry=entry, rank=rank, context=context)
        return plan_tensor(entry, rank, context) if result is None else list(result)

    return plan


def plan_rank(
    table: LayoutTable,
    rank: int,
    options: PlanOptions | None = None,
    *,
    planner: TensorPlanner | None = None,
    **choices: Any,
) -> RankPlan:
    """Validate ``table`` (raising ``PlanError`` before any data moves) and plan ``rank``.

    No communication: every rank calling this on the same table with the same ``options`` (any
    ``PlanOptions``, a ``RefitOptions`` included; ``choices`` replace fields of it by name) derives
    matching sends and receives, in the same order, in the same batches.
    """
    o = PlanOptions.of(options, **choices)
    effective = validate_table(table, ignore=o.ignore, tied=o.tied, cast=o.cast)
    context = context_for(effective)
    batches = assign_batches(effective, o.max_batch_bytes)
    plan_one = planner or tensor_planner()
    ops: list[TransferOp] = []
    tensors = {}
    sources = {}
    for entry in involved(context, rank):
        found = plan_one(entry, rank, context)
        if not found:
            continue
        batch = batches.of[entry.name]
        ops.extend(op if op.batch == batch else replace(op, batch=batch) for op in found)
        tensors[entry.name] = entry.meta
        if entry.src_name is not None:
            sources[entry.name] = entry.src_name
    return RankPlan(rank, tuple(ops), tensors, batches.count, sources)


def involved(context: PlanContext, rank: int) -> list[TableEntry]:
    """Entries with ``rank`` in a layout of either side, in canonical order (via a mesh index)."""
    by_mesh = context.index.extra.get("entries_by_mesh")
    if by_mesh is None:
        by_mesh = {}
        for n, entry in enumerate(context.table.entries):
            for layout in (*entry.src, *entry.dst):
                by_mesh.setdefault(id(layout.mesh), (layout.mesh, []))[1].append(n)
        context.index.extra["entries_by_mesh"] = by_mesh
    found: set[int] = set()
    for mesh, entries in by_mesh.values():
        if rank in context.index.mesh_lookup(mesh):
            found.update(entries)
    return [context.table.entries[n] for n in sorted(found)]
