"""The floors a refit is measured against.

- The wire floor: the byte volumes a refit moves between each pair of ranks, sent as one message
  per pair over the same transport, with nothing else to do (no packing, no unpacking, no local
  copies). A refit's time divided by it says how much of it is overhead beyond moving its bytes.
  The same round with the plan's local-copy volume copied (one memcpy) while it is on the wire is a
  second, fuller floor: where ranks share few cores, local copies compete with the wire for them.
- The memcpy floor: every rank copies the bytes it receives and the bytes it copies locally, each
  as one memcpy, all ranks at once: what a same-host refit of these volumes could cost with one copy
  per byte and no transport at all (the floor a shared-memory transport is held to).
"""

from __future__ import annotations

import torch

from reshard_core import CopyService, OpKind, RankPlan
from reshard_core.transport import message_task_id


def local_volume(plan: RankPlan) -> int:
    """Bytes this rank's plan copies locally per refit."""
    return sum(plan.bytes_of(op) for op in plan.ops if op.kind is OpKind.LOCAL)


def pair_volumes(plan: RankPlan) -> tuple[dict[int, int], dict[int, int]]:
    """``(sends, receives)``: bytes this rank's plan sends to / receives from each peer per refit."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for op in plan.ops:
        if op.kind is OpKind.SEND:
            sends[op.peer] = sends.get(op.peer, 0) + plan.bytes_of(op)
        elif op.kind is OpKind.RECV:
            recvs[op.peer] = recvs.get(op.peer, 0) + plan.bytes_of(op)
    return sends, recvs


class WireFloor:
    """One preallocated, pre-touched buffer per peer and direction; ``run()`` moves them all in one
    round of ``transport`` (a collective with every peer of the plan). ``local`` bytes are copied
    by ``run(with_local=True)`` while the round is on the wire."""

    def __init__(
        self, transport: CopyService, rank: int, sends: dict[int, int], recvs: dict[int, int], local: int = 0
    ):
        self.transport = transport
        self.rank = rank
        self.sends = {peer: torch.ones(n, dtype=torch.uint8) for peer, n in sorted(sends.items())}
        self.recvs = {peer: torch.zeros(n, dtype=torch.uint8) for peer, n in sorted(recvs.items())}
        self.local_src = torch.ones(local, dtype=torch.uint8)
        self.local_dst = torch.zeros(local, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends per round."""
        return sum(b.numel() for b in self.sends.values())

    def run(self, with_local: bool = False) -> None:
        for peer, buf in self.sends.items():
            self.transport.submit_send(buf, peer, message_task_id(0, self.rank, peer))
        for peer, buf in self.recvs.items():
            self.transport.submit_recv(buf, peer, message_task_id(0, peer, self.rank))
        flight = self.transport.start()
        if with_local:  # while the round is on the wire
            self.local_dst.copy_(self.local_src)
        flight.wait()


class MemcpyFloor:
    """Preallocated, pre-touched buffers for this rank's received and local volumes; ``run()`` copies
    each once."""

    def __init__(self, received: int, local: int) -> None:
        self.src = torch.ones(received + local, dtype=torch.uint8)
        self.dst = torch.zeros(received + local, dtype=torch.uint8)
        self.split = received

    def run(self) -> None:
        self.dst[: self.split].copy_(self.src[: self.split])
        self.dst[self.split :].copy_(self.src[self.split :])
