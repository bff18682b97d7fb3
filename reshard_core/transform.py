"""``ReshardTransform``: change what goes on the wire for a tensor, or how received data lands.

Contract (the executor calls these; every rank of a refit must attach transforms that give the same
``should_transform`` answer for a name, because that answer fixes the wire format both sides use):

- ``should_transform(name)``: True when this transform owns the logical tensor ``name``.
- ``prepare_send(name, op, src_view) -> list[Tensor]``: on the sender, for one SEND or LOCAL op, the
  wire tensors for the region ``src_view`` (any count, shapes and dtypes, e.g. MXFP8 data + scale).
- ``prepare_recv(name, op) -> list[Tensor]``: on the receiver, for one RECV op, tensors with exactly
  the count, shapes and dtypes the sender's ``prepare_send`` produces for the same op (both sides
  know the op). The executor receives into them when they are the only thing that peer sends in the
  batch; otherwise it receives one packed message and passes ``finalize_recv`` views of it with the
  same shapes and dtypes, valid only during that call.
- ``finalize_recv(name, op, buffers)``: land the received region (e.g. quantize into persistent
  buffers). For a LOCAL op the executor calls ``prepare_send`` and passes its result straight to
  ``finalize_recv`` on the same rank; each produced tensor keeps its own slot (data and scale never
  share one id).
- ``finalize_tensor(name)`` (optional): called once on a rank after the last RECV or LOCAL op of
  ``name`` on that rank has landed, e.g. to quantize an accumulated whole weight.
- ``transient_bytes(name)`` (optional): bytes this transform holds for ``name`` between its first
  op on a rank and ``finalize_tensor`` (e.g. an accumulator); the executor adds them to its staging
  accounting.

Destination ``TensorSpec.tensor`` may be ``None`` for a tensor a transform owns: the destination
then lives only in ``TensorSpec.source`` (e.g. a persistent MXFP8 data/scale pair the transform
fills), and the executor never touches a destination tensor for that name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .errors import PlanError
from .plan.ops import TransferOp


class ReshardTransform:
    """Base class of format conversions applied while resharding. Subclasses override the hooks."""

    def should_transform(self, name: str) -> bool:
        """True when this transform handles the logical tensor ``name`` (same answer on every rank)."""
        return False

    def prepare_send(self, name: str, op: TransferOp, src_view: torch.Tensor) -> list[torch.Tensor]:
        """Wire tensors for the region of ``op`` read from ``src_view`` (sender side)."""
        raise NotImplementedError(f"{type(self).__name__}.prepare_send")

    def prepare_recv(self, name: str, op: TransferOp) -> list[torch.Tensor]:
        """Receive buffers matching the sender's ``prepare_send`` output for ``op`` (receiver side)."""
        raise NotImplementedError(f"{type(self).__name__}.prepare_recv")

    def finalize_recv(self, name: str, op: TransferOp, buffers: Sequence[torch.Tensor]) -> None:
        """Land the received region of ``op`` from ``buffers`` (receiver side)."""
        raise NotImplementedError(f"{type(self).__name__}.finalize_recv")

    def finalize_tensor(self, name: str) -> None:
        """Called once per rank after every RECV/LOCAL op of ``name`` on it has been finalized."""

    def transient_bytes(self, name: str) -> int:
        """Bytes held for ``name`` from its first op until ``finalize_tensor`` (0 by default)."""
        return 0


def assign_transforms(
    transforms: ReshardTransform | Iterable[ReshardTransform] | None, names: Iterable[str]
) -> dict[str, ReshardTransform]:
    """Map each name some transform claims to that transform; a name claimed twice is a ``PlanError``."""
    if transforms is None:
        return {}
    if isinstance(transforms, ReshardTransform):
        transforms = (transforms,)
    transforms = tuple(transforms)
    owners: dict[str, ReshardTransform] = {}
    for name in names:
        claimed = [t for t in transforms if t.should_transform(name)]
        if len(claimed) > 1:
            kinds = ", ".join(type(t).__name__ for t in claimed)
            raise PlanError(f"tensor {name!r} is claimed by more than one transform: {kinds}")
        if claimed:
            owners[name] = claimed[0]
    return owners
