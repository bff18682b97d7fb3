"""Pure helpers that turn a ``RankPlan`` into per-batch, per-peer work (no tensors, no transport)."""

from __future__ import annotations

import itertools
from collections.abc import Container
from dataclasses import dataclass, field

from ..plan.ops import OpKind, RankPlan, TransferOp

DIRECT_MIN_BYTES = 256 * 1024
"""An op of at least this many bytes travels as its own message, so that each side can move it
without staging when its region is contiguous there (smaller ops share one packed message)."""


Message = tuple[int, int, list[TransferOp]]
"""``(peer, seq, ops)``: one message of a batch (see ``message_groups``)."""


@dataclass
class Batch:
    """The ops of one batch on one rank: sends and receives grouped by peer (plan order kept)."""

    index: int
    sends: dict[int, list[TransferOp]] = field(default_factory=dict)
    recvs: dict[int, list[TransferOp]] = field(default_factory=dict)
    local: list[TransferOp] = field(default_factory=list)


@dataclass
class Schedule:
    """What the executor derives from a plan alone, computed once per plan (``build_schedule``):
    the batches, each batch's messages in posting order, and where transformed tensors start and end."""

    batches: list[Batch]
    receives: dict[int, list[Message]]
    """By batch index: the messages to receive, peers taken in turn (``interleaved``)."""
    sends: dict[int, list[Message]]
    finals: dict[int, list[str]]
    firsts: dict[int, list[str]]


def build_schedule(plan: RankPlan, transformed: Container[str]) -> Schedule:
    """The ``Schedule`` of ``plan`` when the names in ``transformed`` go through a transform."""
    batches = split_batches(plan)
    return Schedule(
        batches,
        {b.index: interleaved(plan, b.recvs) for b in batches},
        {b.index: interleaved(plan, b.sends) for b in batches},
        finalize_points(plan, transformed),
        first_points(plan, transformed),
    )


def interleaved(plan: RankPlan, per_peer: dict[int, list[TransferOp]]) -> list[Message]:
    """Every message of one direction in a batch, taking the peers in turn (so no peer waits for all
    of another's messages to be packed); each pair's messages keep ``seq`` order."""
    queues = [(peer, list(enumerate(message_groups(plan, ops)))) for peer, ops in per_peer.items()]
    out: list[Message] = []
    for turn in itertools.zip_longest(*(q for _, q in queues)):
        for (peer, _), item in zip(queues, turn, strict=True):
            if item is not None:
                out.append((peer, item[0], item[1]))
    return out


def split_batches(plan: RankPlan) -> list[Batch]:
    """The plan's non-empty batches in ascending order (the plan lists ops ordered by batch)."""
    batches: dict[int, Batch] = {}
    for op in plan.ops:
        batch = batches.setdefault(op.batch, Batch(op.batch))
        if op.kind is OpKind.LOCAL:
            batch.local.append(op)
        else:
            per_peer = batch.sends if op.kind is OpKind.SEND else batch.recvs
            per_peer.setdefault(op.peer, []).append(op)
    return [batches[k] for k in sorted(batches)]


def message_groups(plan: RankPlan, ops: list[TransferOp]) -> list[list[TransferOp]]:
    """How the ops between this rank and one peer in one batch travel, one list per message.

    Every op under ``DIRECT_MIN_BYTES`` shares one packed message, which comes first; every larger op
    is a message of its own, in plan order. Both sides derive the same messages from the same ops.
    """
    small = [op for op in ops if plan.bytes_of(op) < DIRECT_MIN_BYTES]
    large = [[op] for op in ops if plan.bytes_of(op) >= DIRECT_MIN_BYTES]
    return ([small] if small else []) + large


def finalize_points(plan: RankPlan, names: Container[str]) -> dict[int, list[str]]:
    """For each batch, the names in ``names`` whose last RECV/LOCAL op on this rank is in it."""
    last: dict[str, int] = {}
    for op in plan.ops:
        if op.kind is not OpKind.SEND and op.name in names:
            last[op.name] = op.batch
    points: dict[int, list[str]] = {}
    for name, batch in last.items():
        points.setdefault(batch, []).append(name)
    return points


def first_points(plan: RankPlan, names: Container[str]) -> dict[int, list[str]]:
    """For each batch, the names in ``names`` whose first RECV/LOCAL op on this rank is in it."""
    first: dict[str, int] = {}
    for op in plan.ops:
        if op.kind is not OpKind.SEND and op.name in names:
            first.setdefault(op.name, op.batch)
    points: dict[int, list[str]] = {}
    for name, batch in first.items():
        points.setdefault(batch, []).append(name)
    return points
