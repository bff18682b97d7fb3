"""Offline simulation of a refit: plan ranks in one process, measure, and check validity.

``simulate(model, src, dst, ...)`` builds the layout table (``layouts``), sizes the compact exchange
every rank would receive (``exchange.contribute``), plans every rank — or, with ``sample=N``, N
evenly spread ranks plus the busiest candidates (the ranks holding the most bytes and the most
tensors on either side) — timing each ``plan_rank`` on a cold planner in process CPU seconds, and
runs ``check.check_plans`` (pairs with an unplanned end are skipped).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod

from ..catalogue.shapes import ModelShapes
from ..exchange.contribute import payloads_from_table
from ..plan.ops import OpKind, RankPlan
from ..plan.planner_context import context_for
from ..plan.rank import plan_rank
from ..plan.table import LayoutTable
from .check import check_plans
from .layouts import build_table
from .parallel import Parallel


@dataclass(frozen=True)
class RankStats:
    """One planned rank; ``plan_seconds`` is CPU time (one core), steady on a shared machine."""

    rank: int
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int
    ops: int
    plan_seconds: float


@dataclass
class SimulationReport:
    model: str
    src: str
    dst: str
    ranks: int
    planned: list[RankStats] = field(default_factory=list)
    metadata_bytes: int = 0
    metadata_bytes_padded: int = 0
    valid: bool = True
    problems: list[str] = field(default_factory=list)
    pairs_checked: int = 0
    tensors: int = 0
    model_bytes: int = 0
    formats: tuple[str, str] | None = None
    gather_first_bytes: int | None = None
    """Set for a refit across formats: what a gather-first converter would move (``formats``)."""
    shard_to_shard_bytes: int | None = None
    """Set with ``gather_first_bytes``: what this refit moves in all, every rank (planned or not)."""

    @property
    def plan_seconds_max(self) -> float:
        return max((s.plan_seconds for s in self.planned), default=0.0)

    @property
    def plan_seconds_mean(self) -> float:
        return sum(s.plan_seconds for s in self.planned) / len(self.planned) if self.planned else 0.0

    @property
    def busiest(self) -> RankStats | None:
        return max(self.planned, key=lambda s: s.plan_seconds, default=None)

    def totals(self) -> dict[str, int]:
        return {
            "bytes_remote_total": sum(s.bytes_sent for s in self.planned),
            "bytes_received_total": sum(s.bytes_received for s in self.planned),
            "bytes_local_total": sum(s.bytes_local for s in self.planned),
            "messages_total": sum(s.messages_sent for s in self.planned),
            "ops_total": sum(s.ops for s in self.planned),
        }

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "src": self.src,
            "dst": self.dst,
            "ranks": self.ranks,
            "ranks_planned": len(self.planned),
            "tensors": self.tensors,
            "model_bytes": self.model_bytes,
            "metadata_bytes": self.metadata_bytes,
            "metadata_bytes_padded": self.metadata_bytes_padded,
            "plan_seconds_max": self.plan_seconds_max,
            "plan_seconds_mean": self.plan_seconds_mean,
            **self.totals(),
            "pairs_checked": self.pairs_checked,
            **(
                {
                    "formats": list(self.formats),
                    "gather_first_bytes": self.gather_first_bytes,
                    "shard_to_shard_bytes": self.shard_to_shard_bytes,
                }
                if self.formats
                else {}
            ),
            "valid": self.valid,
            "problems": self.problems,
            "per_rank": [vars(s) for s in self.planned],
        }


def rank_stats(plan: RankPlan, seconds: float) -> RankStats:
    sent = received = local = 0
    out, inbound = set(), set()
    for op in plan.ops:
        nbytes = prod(op.sizes) * plan.tensors[op.name].dtype.itemsize
        if op.kind is OpKind.SEND:
            sent += nbytes
            out.add((op.batch, op.peer))
        elif op.kind is OpKind.RECV:
            received += nbytes
            inbound.add((op.batch, op.peer))
        else:
            local += nbytes
    return RankStats(plan.rank, sent, received, local, len(out), len(inbound), len(plan.ops), seconds)


def busiest_candidates(table: LayoutTable, top: int = 3) -> list[int]:
    """Ranks holding the most bytes and the most tensors on either side (cheap: per layout)."""
    index = context_for(table).index
    held_bytes: dict[int, int] = {}
    held_count: dict[int, int] = {}
    groups: dict[tuple, int] = {}
    for e in table.entries:
        for layout in (*e.src, *e.dst):
            key = (id(layout), tuple(e.meta.shape), e.meta.dtype.itemsize)
            groups[key] = groups.get(key, 0) + 1
            groups.setdefault(("obj", id(layout)), layout)
    for (lid, shape, itemsize), count in [(k, v) for k, v in groups.items() if k[0] != "obj"]:
        dims = index.layout_dims(groups[("obj", lid)], shape)
        mesh = dims.layout.mesh
        for coord, rank in zip(mesh.coords(), mesh.ranks, strict=True):
            held = dims.layout.dim_intervals_at(shape, coord)
            n = prod(sum(b - a for a, b in d) for d in held)
            held_bytes[rank] = held_bytes.get(rank, 0) + count * n * itemsize
            held_count[rank] = held_count.get(rank, 0) + count
    pick = sorted(held_bytes, key=lambda r: -held_bytes[r])[:top]
    pick += sorted(held_count, key=lambda r: -held_count[r])[:top]
    return list(dict.fromkeys(pick))


def simulate(
    model: ModelShapes,
    src: Parallel,
    dst: Parallel,
    *,
    dst_offset: int = 0,
    max_batch_bytes: int | None = None,
    sample: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    ranks: Sequence[int] | None = None,
    table: LayoutTable | None = None,
    cast: bool = False,
) -> SimulationReport:
    """Plan and check a refit of ``model`` from ``src`` to ``dst`` (see module docstring).

    ``table`` replaces the Megatron-named table ``layouts.build_table`` lays out (a refit across
    formats: ``formats.format_table``). ``cast``: as ``refit(..., cast=True)``, accept tensors whose
    dtype alone differs (an engine keeping a router in fp32)."""
    if table is None:
        table = build_table(model, src, dst, dst_offset)
    world = sorted(set(range(src.world)) | set(range(dst_offset, dst_offset + dst.world)))
    payloads = payloads_from_table(table, world)
    sizes = [len(p) for p in payloads.values()]
    report = SimulationReport(
        model=model.name,
        src=str(src),
        dst=str(dst) + (f" @ +{dst_offset}" if dst_offset else ""),
        ranks=len(world),
        metadata_bytes=sum(sizes) + 8 * len(world),
        metadata_bytes_padded=(max(sizes) + 8) * len(world),
        tensors=len(table),
        model_bytes=model.nbytes,
    )
    if ranks is None:
        ranks = world
        if sample is not None and sample < len(world):
            step = len(world) / sample
            ranks = sorted({world[int(i * step)] for i in range(sample)} | set(busiest_candidates(table)))
    plans = {}
    for n, rank in enumerate(ranks):
        # a real rank plans in its own process: keep earlier ranks' plans out of its GC passes
        gc.freeze()
        start = time.process_time()
        plan = plan_rank(fresh(table), rank, max_batch_bytes=max_batch_bytes, cast=cast)
        seconds = time.process_time() - start
        plans[rank] = plan
        report.planned.append(rank_stats(plan, seconds))
        if progress is not None:
            progress(n + 1, len(ranks))
    gc.unfreeze()
    check = check_plans(table, plans, cast=cast)
    report.valid, report.problems, report.pairs_checked = check.valid, check.problems, check.pairs_checked
    return report


def fresh(table: LayoutTable) -> LayoutTable:
    """The same entries with empty caches: a rank plans cold, as a real rank would."""
    return LayoutTable(table.entries)
