"""Apply a set of rank plans in one process with plain tensor copies (a reference executor for tests).

Sends are queued per ordered pair (A, B) in A's op order; each receive on B from A takes the next
one and must describe the same tensor, batch, region and local views — the pairing contract the
real transports rely on. Every write into a destination element is counted.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping

import torch

from ..errors import PlanError
from ..plan.ops import OpKind, RankPlan, TransferOp

Key = tuple[int, str]
"""(rank, tensor name)."""


def _view(t: torch.Tensor, start: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (a, n) in enumerate(zip(start, sizes, strict=True)):
        t = t.narrow(d, a, n)
    return t


def _pair_key(op: TransferOp) -> tuple:
    return (op.name, op.batch, op.offsets, op.sizes, op.src_local, op.dst_local)


def replay(
    plans: Mapping[int, RankPlan],
    src: Mapping[Key, torch.Tensor],
    dst: Mapping[Key, torch.Tensor],
) -> dict[Key, torch.Tensor]:
    """Run every plan's ops on in-memory local tensors; return per-destination write counts.

    ``src[(rank, name)]``/``dst[(rank, name)]`` are each rank's local tensors (destination tensors
    are written in place). Raises ``PlanError`` when a receive has no matching send, or sends are
    left unreceived, or ops are not in batch order.
    """
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in dst.items()}
    wire: dict[tuple[int, int], deque] = defaultdict(deque)
    for rank, plan in sorted(plans.items()):
        batches = [op.batch for op in plan.ops]
        if batches != sorted(batches):
            raise PlanError(f"rank {rank}: ops are not in batch order")
        for op in plan.ops:
            if op.kind is OpKind.SEND or op.kind is OpKind.LOCAL:
                data = _view(src[(rank, plan.source_names.get(op.name, op.name))], op.src_local, op.sizes)
                if op.kind is OpKind.SEND:
                    wire[(rank, op.peer)].append((_pair_key(op), data.clone()))
                else:
                    _write(dst, counts, (rank, op.name), op, data)
    for rank, plan in sorted(plans.items()):
        for op in plan.ops:
            if op.kind is not OpKind.RECV:
                continue
            queue = wire[(op.peer, rank)]
            if not queue:
                raise PlanError(
                    f"{op.name}: rank {rank} receives from rank {op.peer}, which sends nothing more"
                )
            sent_key, data = queue.popleft()
            if sent_key != _pair_key(op):
                raise PlanError(
                    f"{op.name}: receive on rank {rank} from rank {op.peer} {_pair_key(op)} does not match "
                    f"the send in the same position {sent_key}"
                )
            _write(dst, counts, (rank, op.name), op, data)
    left = {pair: len(q) for pair, q in wire.items() if q}
    if left:
        raise PlanError(f"sends without receives (sender, receiver): count {left}")
    return counts


def _write(dst, counts, key: Key, op: TransferOp, data: torch.Tensor) -> None:
    _view(dst[key], op.dst_local, op.sizes).copy_(data)
    _view(counts[key], op.dst_local, op.sizes).add_(1)
