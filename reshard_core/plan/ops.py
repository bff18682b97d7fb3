"""Plan items: small frozen records both sides of a transfer derive identically."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ..specs import TensorMeta


class OpKind(enum.Enum):
    LOCAL = "local"  # copy inside the rank, view to view
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class TransferOp:
    """One rectangular region of one logical tensor moving from one rank to another (or itself).

    ``offsets``/``sizes`` are global coordinates. ``src_local`` is where the region starts inside
    the source rank's local tensor (set for SEND and LOCAL), ``dst_local`` inside the destination
    rank's local tensor (set for RECV and LOCAL). ``peer`` is the other rank (this rank for LOCAL).
    ``batch`` is the execution batch; sender and receiver always agree on it.
    """

    kind: OpKind
    name: str
    peer: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_local: tuple[int, ...] | None
    dst_local: tuple[int, ...] | None
    batch: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank does in a refit, in execution order.

    ``ops`` are ordered by batch, then by a canonical order that the peer of every SEND derives
    for its matching RECV, so the n-th send from A to B pairs with the n-th receive on B from A.
    """

    rank: int
    ops: tuple[TransferOp, ...]
    tensors: dict[str, TensorMeta] = field(compare=False)
    num_batches: int = 1

    def bytes_of(self, op: TransferOp) -> int:
        return op.numel * self.tensors[op.name].itemsize
