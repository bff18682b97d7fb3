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

    ``sizes`` is the region's extent, ``src_local`` where it starts inside the source rank's local
    tensor and ``dst_local`` inside the destination rank's (the built-in planner sets both on every
    op, so either end can check the other's view). ``offsets`` is the region's global start. Tiles
    that are adjacent in both local tensors are merged into one op even when they are not adjacent
    globally (strided layouts); ``offsets`` then locates the first tile. ``peer`` is the other rank
    (this rank for LOCAL). ``batch`` is the execution batch; sender and receiver always agree on it.
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
    source_names: dict[str, str] = field(default_factory=dict, compare=False)
    """Destination name -> source tensor name where they differ (explicit tied-embedding fallback):
    a sender reads ``source_names.get(op.name, op.name)``."""

    def bytes_of(self, op: TransferOp) -> int:
        return op.numel * self.tensors[op.name].dtype.itemsize
