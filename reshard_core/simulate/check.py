"""Metadata-only validity check of plans for many ranks (no tensors needed, scales to thousands).

For the planned ranks it verifies:

- **pairing**: for every ordered pair of planned ranks (A, B), A's sends to B and B's receives from
  A are the same list (tensor, batch, region, both local views), position by position;
- **exact cover**: on every planned destination rank, the local views written for each tensor
  (receives and local copies) lie inside the local tensor, are pairwise disjoint and add up to it;
- **right coordinates**: each written view maps, through the destination layout, to the same
  global elements that its source view maps to through the holder's source layout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

from ..layout import take_intervals
from ..plan.ops import OpKind, RankPlan, TransferOp
from ..plan.planner_context import context_for
from ..plan.validate import Tied, validate_table

_MAX_PROBLEMS = 20


@dataclass
class CheckReport:
    valid: bool = True
    problems: list[str] = field(default_factory=list)
    pairs_checked: int = 0
    ranks_checked: int = 0

    def fail(self, text: str) -> None:
        self.valid = False
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(text)


def check_plans(
    table, plans: Mapping[int, RankPlan], ignore: Sequence[str] = (), tied: Tied = None, cast: bool = False
) -> CheckReport:
    """Check ``plans`` (a subset of ranks is fine: pairs with an unplanned end are skipped)."""
    effective = validate_table(table, ignore=ignore, tied=tied, cast=cast)
    report = CheckReport(ranks_checked=len(plans))
    _check_pairing(plans, report)
    index = context_for(effective).index
    for rank, plan in plans.items():
        written: dict[str, list[TransferOp]] = defaultdict(list)
        for op in plan.ops:
            if op.kind is not OpKind.SEND:
                written[op.name].append(op)
        for entry in effective.entries:
            shape = tuple(entry.meta.shape)
            dst = index.side(entry.name, "dst", entry.dst, shape)
            place = dst.member(rank)
            if place is None:
                if entry.name in written:
                    report.fail(f"{entry.name}: rank {rank} writes it but holds no destination copy")
                continue
            intervals = dst.dims[place[0]].layout.dim_intervals_at(shape, place[1])
            ops = written.get(entry.name, [])
            _check_cover(entry.name, rank, intervals, ops, report)
            src = index.side(entry.name, "src", entry.src, shape)
            for op in ops:
                holder = src.member(op.peer)
                if holder is None:
                    report.fail(
                        f"{entry.name}: rank {rank} receives from rank {op.peer}, which holds no source"
                    )
                    continue
                held = src.dims[holder[0]].layout.dim_intervals_at(shape, holder[1])
                if _to_global(held, op.src_local, op.sizes) != _to_global(intervals, op.dst_local, op.sizes):
                    report.fail(f"{entry.name}: rank {rank} op {op} moves elements to the wrong coordinates")
    return report


def _check_pairing(plans: Mapping[int, RankPlan], report: CheckReport) -> None:
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank, plan in plans.items():
        for op in plan.ops:
            key = (op.name, op.batch, op.offsets, op.sizes, op.src_local, op.dst_local)
            if op.kind is OpKind.SEND:
                sends[(rank, op.peer)].append(key)
            elif op.kind is OpKind.RECV:
                recvs[(op.peer, rank)].append(key)
    for pair in sends.keys() | recvs.keys():
        if pair[0] not in plans or pair[1] not in plans:
            continue
        report.pairs_checked += 1
        a, b = sends.get(pair, []), recvs.get(pair, [])
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            report.fail(
                f"ranks {pair[0]}→{pair[1]}: {len(a)} sends vs {len(b)} receives, "
                f"first mismatch at position {at}"
            )


def _check_cover(name: str, rank: int, intervals, ops: list[TransferOp], report: CheckReport) -> None:
    local_shape = tuple(sum(b - a for a, b in d) for d in intervals)
    total = 0
    boxes = []
    for op in ops:
        if any(o < 0 or o + s > n for o, s, n in zip(op.dst_local, op.sizes, local_shape, strict=True)):
            report.fail(f"{name}: rank {rank} op {op} writes outside its local shape {local_shape}")
            return
        total += prod(op.sizes)
        boxes.append((op.dst_local, op.sizes))
    if total != prod(local_shape):
        report.fail(f"{name}: rank {rank} gets {total} elements written for {prod(local_shape)} held")
        return
    # sweep along dim 0: only boxes overlapping there can collide
    boxes.sort()
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in boxes:
        active = [b for b in active if not local_shape or b[0][0] + b[1][0] > box[0][0]]
        for other in active:
            if all(
                max(a, c) < min(a + s, c + t)
                for a, s, c, t in zip(box[0], box[1], other[0], other[1], strict=True)
            ):
                report.fail(f"{name}: rank {rank} writes local region {box} twice")
                return
        active.append(box)


def _to_global(intervals, start: tuple[int, ...], sizes: tuple[int, ...]) -> tuple:
    return tuple(tuple(take_intervals(d, a, a + n)) for d, a, n in zip(intervals, start, sizes, strict=True))
