"""The wire floor: the byte volumes a refit moves between each pair of ranks, sent as one message
per pair over the same transport, with nothing else to do (no packing, no unpacking, no local copies).

A refit's time divided by this floor says how much of it is overhead beyond moving its bytes.
"""

from __future__ import annotations

import torch

from ..execute.schedule import message_task_id
from ..plan.ops import OpKind, RankPlan
from ..transport.copy_service import CopyService


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
    round of ``transport`` (a collective with every peer of the plan)."""

    def __init__(self, transport: CopyService, rank: int, sends: dict[int, int], recvs: dict[int, int]):
        self.transport = transport
        self.rank = rank
        self.sends = {peer: torch.ones(n, dtype=torch.uint8) for peer, n in sorted(sends.items())}
        self.recvs = {peer: torch.zeros(n, dtype=torch.uint8) for peer, n in sorted(recvs.items())}

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends per round."""
        return sum(b.numel() for b in self.sends.values())

    def run(self) -> None:
        for peer, buf in self.sends.items():
            self.transport.submit_send(buf, peer, message_task_id(0, self.rank, peer))
        for peer, buf in self.recvs.items():
            self.transport.submit_recv(buf, peer, message_task_id(0, peer, self.rank))
        self.transport.run()
