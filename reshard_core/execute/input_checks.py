"""Checks run on a rank's plan and tensors before any data moves; each failure is one ``PlanError``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import PlanError
from ..plan.ops import OpKind, RankPlan, TransferOp
from ..specs import TensorMeta


def source_name(plan: RankPlan, name: str) -> str:
    """The source tensor name feeding destination ``name`` (differs for a tied destination)."""
    return (getattr(plan, "source_names", None) or {}).get(name, name)


def check_inputs(
    plan: RankPlan,
    src: Mapping[str, torch.Tensor | None],
    dst: Mapping[str, torch.Tensor | None],
    transformed: Mapping[str, object],
    *,
    cast: bool,
    device: str,
) -> None:
    """Raise ``PlanError`` naming the tensor on the first problem; return when the plan can run.

    ``transformed`` holds the names a transform owns (their destination may be absent). ``device``
    is the transport's ``device`` capability (``"cpu"``, ``"cuda"`` or ``"any"``).
    """
    last_batch = None
    for op in plan.ops:
        if last_batch is not None and op.batch < last_batch:
            raise PlanError(f"plan of rank {plan.rank} lists batch {op.batch} after batch {last_batch}")
        last_batch = op.batch
        meta = plan.tensors.get(op.name)
        if meta is None:
            raise PlanError(f"tensor {op.name!r}: rank {plan.rank} has an op for it but no metadata")
        if op.kind is not OpKind.LOCAL and op.peer == plan.rank:
            raise PlanError(f"tensor {op.name!r}: rank {plan.rank} has a {op.kind.value} op with itself")
        if op.kind is not OpKind.RECV:
            source = src.get(source_name(plan, op.name))
            _check_side(op, meta, source, "source", op.src_local, cast, device, plan.rank)
        if op.kind is not OpKind.SEND and op.name not in transformed:
            _check_side(op, meta, dst.get(op.name), "destination", op.dst_local, cast, device, plan.rank)


def _check_side(
    op: TransferOp,
    meta: TensorMeta,
    tensor: torch.Tensor | None,
    side: str,
    local: tuple[int, ...] | None,
    cast: bool,
    device: str,
    rank: int,
) -> None:
    name = op.name
    if tensor is None:
        raise PlanError(f"tensor {name!r}: the plan of rank {rank} needs its {side} tensor, none was given")
    if tensor.dtype != meta.dtype and not cast:
        raise PlanError(
            f"tensor {name!r}: {side} dtype {tensor.dtype} differs from the plan's dtype {meta.dtype} "
            "(pass cast=True to convert)"
        )
    if local is None or len(local) != tensor.dim() or len(op.sizes) != tensor.dim():
        raise PlanError(f"tensor {name!r}: {side} region {local} does not fit a {tensor.dim()}-d tensor")
    if any(o < 0 or o + s > n for o, s, n in zip(local, op.sizes, tensor.shape, strict=True)):
        raise PlanError(
            f"tensor {name!r}: {side} region at {local} of size {op.sizes} "
            f"is outside the local tensor of shape {tuple(tensor.shape)}"
        )
    if op.kind is not OpKind.LOCAL and device != "any" and tensor.device.type != device:
        raise PlanError(
            f"tensor {name!r}: {side} tensor is on {tensor.device}, the transport moves {device} only"
        )
