"""Turn a rank's program into stream operations; the operations themselves are pluggable.

``StreamOps`` is the whole device surface the engine needs: the NVSHMEM implementation lives in
``symmetric.py``, and the tests drive the same ``enqueue`` with a CPU simulator of a world.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from .exchange import LocalRun
from .slots import RankProgram

Queue = Sequence[tuple[torch.Tensor, int]]
Views = dict[tuple[int, int], torch.Tensor]


class StreamOps(Protocol):
    """Asynchronous operations of one rank. Send-side calls go to the stream for their ``peer``
    (one per receiver), receive-side calls to the receive stream; each stream runs its operations
    in call order."""

    def grant(self, peer: int) -> None:
        """(receive stream) Add 1 to ``credits[me]`` on ``peer``."""

    def wait_credit(self, peer: int, value: int) -> None:
        """(stream to ``peer``) Block it until ``credits[peer] >= value`` here."""

    def put(self, peer: int, src: torch.Tensor, slot: int, offset: int) -> None:
        """(stream to ``peer``) Copy ``src`` (uint8) to ``peer``'s slot at ``offset``, then add 1 to
        ``arrivals[slot]`` on ``peer``; the signal lands only after the data."""

    def wait_arrival(self, slot: int, value: int) -> None:
        """(receive stream) Block the stream until ``arrivals[slot] >= value`` here."""

    def unpack(self, slot: int, pieces: Sequence[tuple[torch.Tensor, int]]) -> None:
        """(receive stream) For each ``(dst, offset)``, copy ``len(dst)`` bytes at ``offset`` of
        this rank's ``slot`` into ``dst`` (one round's pieces, in one call)."""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def split_messages(sends: Queue, recvs: Queue) -> tuple[Views, Views, LocalRun]:
    """Key a run's submitted ``(tensor, peer group rank)`` queues by ``(peer, order)`` as flat byte
    views (the n-th message to a peer has order n), and describe the run for the exchange."""
    views: tuple[Views, Views] = ({}, {})
    sizes: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
    for side, queue in enumerate((sends, recvs)):
        orders: dict[int, int] = {}
        for tensor, peer in queue:
            view = byte_view(tensor)
            views[side][(peer, orders.get(peer, 0))] = view
            orders[peer] = orders.get(peer, 0) + 1
            sizes[side].append((peer, view.numel()))
    return views[0], views[1], LocalRun(tuple(sizes[0]), tuple(sizes[1]))


def enqueue(
    program: RankProgram,
    sends: Mapping[tuple[int, int], torch.Tensor],
    recvs: Mapping[tuple[int, int], torch.Tensor],
    ops: StreamOps,
) -> None:
    """Issue ``program`` on ``ops``. ``sends[(dst, order)]`` / ``recvs[(src, order)]`` are the flat
    uint8 views of the run's messages (peers and orders as in the schedule)."""
    for peer in program.grants:
        ops.grant(peer)
    for step in program.sends:
        ops.wait_credit(step.peer, step.credit)
        for p in step.pieces:
            src = sends[(p.dst, p.order)][p.msg_offset : p.msg_offset + p.nbytes]
            ops.put(p.dst, src, p.slot, p.slot_offset)
    for step in program.recvs:
        if step.pieces:
            ops.wait_arrival(step.slot, step.arrived)
            dsts = [recvs[(p.src, p.order)][p.msg_offset : p.msg_offset + p.nbytes] for p in step.pieces]
            ops.unpack(step.slot, [(dst, p.slot_offset) for dst, p in zip(dsts, step.pieces, strict=True)])
        for peer in step.grants:
            ops.grant(peer)
