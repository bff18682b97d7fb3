"""A CPU simulator of a world running the NVSHMEM engine: symmetric slots, signal words, streams.

Each rank records the operations ``engine.enqueue`` issues, one queue per stream (a send stream
per receiver, one receive stream) and run. The world then executes queue heads in a random order:
a wait runs once its signal condition holds, a put lands data and signal at once (put-with-signal),
and a rank starts its next run only when all of its streams finished the previous one (``run()``
returns after completion). The simulator checks that no put overwrites slot bytes that were not
unpacked yet and that no unpack reads bytes that did not arrive; it raises ``Deadlock`` when
nothing can run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class Deadlock(AssertionError):
    pass


class SlotConflict(AssertionError):
    pass


@dataclass
class RankState:
    slots: list[torch.Tensor]
    arrivals: list[int]
    pending: list[torch.Tensor]  # per slot: bytes written, not unpacked yet
    credits: dict[int, int] = field(default_factory=dict)
    runs: list[list[list]] = field(default_factory=list)  # per run: its stream queues


class SimOps:
    """``StreamOps`` of one rank: records operations into that rank's current run."""

    def __init__(self, world: SimWorld, rank: int):
        self.send_qs: dict[int, list] = {}
        self.recv_q: list = []
        self.queues: list[list] = [self.recv_q]
        world.ranks[rank].runs.append(self.queues)

    def _send_q(self, peer: int) -> list:
        if peer not in self.send_qs:
            self.send_qs[peer] = []
            self.queues.append(self.send_qs[peer])
        return self.send_qs[peer]

    def grant(self, peer: int) -> None:
        self.recv_q.append(("grant", peer))

    def wait_credit(self, peer: int, value: int) -> None:
        self._send_q(peer).append(("wait_credit", peer, value))

    def put(self, peer: int, src: torch.Tensor, slot: int, offset: int) -> None:
        self._send_q(peer).append(("put", peer, src, slot, offset))

    def wait_arrival(self, slot: int, value: int) -> None:
        self.recv_q.append(("wait_arrival", slot, value))

    def unpack(self, slot: int, pieces: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.recv_q.append(("unpack", slot, list(pieces)))


class SimWorld:
    def __init__(self, world: int, slots: int, slot_bytes: int):
        self.ranks = [
            RankState(
                slots=[torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(slots)],
                arrivals=[0] * slots,
                pending=[torch.zeros(slot_bytes, dtype=torch.bool) for _ in range(slots)],
            )
            for _ in range(world)
        ]
        self.puts = 0

    def ops(self, rank: int) -> SimOps:
        """A fresh recorder for ``rank``'s next run."""
        return SimOps(self, rank)

    def _heads(self, rank: int) -> list[list]:
        runs = self.ranks[rank].runs
        while runs and not any(runs[0]):
            runs.pop(0)
        return [q for q in runs[0] if q] if runs else []

    def _ready(self, rank: int, op: tuple) -> bool:
        me = self.ranks[rank]
        if op[0] == "wait_credit":
            return me.credits.get(op[1], 0) >= op[2]
        if op[0] == "wait_arrival":
            return me.arrivals[op[1]] >= op[2]
        return True

    def _execute(self, rank: int, op: tuple) -> None:
        kind = op[0]
        if kind == "grant":
            peer = self.ranks[op[1]]
            peer.credits[rank] = peer.credits.get(rank, 0) + 1
        elif kind == "put":
            _, peer, src, slot, offset = op
            target = self.ranks[peer]
            span = slice(offset, offset + len(src))
            if target.pending[slot][span].any():
                raise SlotConflict(f"rank {rank} overwrote undrained bytes of rank {peer} slot {slot}")
            target.slots[slot][span] = src
            target.pending[slot][span] = True
            target.arrivals[slot] += 1
            self.puts += 1
        elif kind == "unpack":
            _, slot, pieces = op
            me = self.ranks[rank]
            for dst, offset in pieces:
                span = slice(offset, offset + len(dst))
                if not me.pending[slot][span].all():
                    raise SlotConflict(f"rank {rank} unpacked bytes of slot {slot} that never arrived")
                dst.copy_(me.slots[slot][span])
                me.pending[slot][span] = False

    def run(self, seed: int = 0) -> None:
        """Execute every recorded operation in a random (but valid) order."""
        rng = random.Random(seed)
        while True:
            candidates = [
                (rank, queue)
                for rank in range(len(self.ranks))
                for queue in self._heads(rank)
                if self._ready(rank, queue[0])
            ]
            if not candidates:
                break
            rank, queue = rng.choice(candidates)
            self._execute(rank, queue.pop(0))
        stuck = {r: [q[0][0] for q in self._heads(r)] for r in range(len(self.ranks)) if self._heads(r)}
        if stuck:
            raise Deadlock(f"no operation can run; blocked heads: {stuck}")
