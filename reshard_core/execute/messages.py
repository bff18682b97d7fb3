"""One message per peer per batch: packing what a rank sends, preparing and landing what it receives.

A message is a sequence of slots (``slots.py``), one per wire tensor: the source region of an
untransformed op (in the plan's dtype), or each tensor a transform produced for the op. A message
goes on the wire without staging when its slots already lie in memory as the message would hold
them: one contiguous tensor of the right dtype, or several contiguous regions of one storage laid
end to end in slot order (e.g. the two row ranges of a stride-2 fc1 shard that land next to each
other in the destination). Then the sender sends the source memory itself and the receiver receives
straight into the destination (or the transform's receive buffer); each side decides on its own,
since both derive the same byte layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..plan.ops import RankPlan, TransferOp
from ..transform import ReshardTransform
from .check import region, source_name
from .pool import StagingPool
from .slots import Slot, layout_slots, slot_view
from .stats import ExecStats, StagingMeter


@dataclass
class ExecContext:
    """Everything the executor's steps share for one ``execute_plan`` call."""

    plan: RankPlan
    src: Mapping[str, torch.Tensor | None]
    dst: Mapping[str, torch.Tensor | None]
    transforms: Mapping[str, ReshardTransform]
    stats: ExecStats = field(default_factory=ExecStats)
    meter: StagingMeter = field(default_factory=StagingMeter)
    pool: StagingPool = field(default_factory=StagingPool)
    views: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """Region views by ``(id(op), side)``, kept across executions by an ``ExecMemo``."""

    def wire_dtype(self, name: str) -> torch.dtype:
        return self.plan.tensors[name].dtype

    def source(self, name: str) -> torch.Tensor:
        """The local source tensor feeding ``name`` (a tied destination reads another name)."""
        return self.src[source_name(self.plan, name)]

    def src_view(self, op: TransferOp) -> torch.Tensor:
        """The view of ``op``'s region in its local source tensor."""
        view = self.views.get((id(op), "src"))
        if view is None:
            view = self.views[(id(op), "src")] = region(self.source(op.name), op.src_local, op.sizes)
        return view

    def dst_view(self, op: TransferOp) -> torch.Tensor:
        """The view of ``op``'s region in its local destination tensor."""
        view = self.views.get((id(op), "dst"))
        if view is None:
            view = self.views[(id(op), "dst")] = region(self.dst[op.name], op.dst_local, op.sizes)
        return view


@dataclass
class Outgoing:
    """The message for one peer: ``message`` is submitted as is; ``staged`` bytes are held until sent;
    ``pooled`` when ``message`` is a staging buffer to give back to the pool."""

    peer: int
    message: torch.Tensor
    staged: int
    pooled: bool = False


@dataclass
class Landing:
    """How one received op lands: into ``target`` (a destination view) or through its transform."""

    op: TransferOp
    slots: list[Slot]
    target: torch.Tensor | None
    buffers: list[torch.Tensor] | None
    device: torch.device


@dataclass
class Incoming:
    """The message from one peer; ``direct`` when ``message`` is the landing place itself."""

    peer: int
    message: torch.Tensor
    landings: list[Landing]
    direct: bool
    staged: int

    @property
    def pooled(self) -> bool:
        return not self.direct


def _send_pieces(ctx: ExecContext, op: TransferOp) -> tuple[list[tuple[torch.Tensor, torch.dtype]], int]:
    """The wire tensors of one SEND op with the dtype each travels in, and the bytes freshly produced."""
    view = ctx.src_view(op)
    transform = ctx.transforms.get(op.name)
    if transform is None:
        return [(view, ctx.wire_dtype(op.name))], 0
    wire = transform.prepare_send(op.name, op, view)
    return [(t, t.dtype) for t in wire], sum(t.nbytes for t in wire)


def build_outgoing(ctx: ExecContext, peer: int, ops: list[TransferOp]) -> Outgoing | None:
    """Pack every SEND op to ``peer`` of one batch into one message (None when it has no bytes)."""
    pieces: list[tuple[torch.Tensor, torch.dtype]] = []
    produced = 0
    for op in ops:
        more, nbytes = _send_pieces(ctx, op)
        pieces += more
        produced += ctx.meter.hold(nbytes)
    slots, total = layout_slots([(tuple(t.shape), dtype) for t, dtype in pieces])
    if total == 0:
        ctx.meter.release(produced)
        return None
    if all(t.dtype == dtype for t, dtype in pieces):
        span = contiguous_span([t for t, _ in pieces], slots, total)
        if span is not None:
            return Outgoing(peer, span, produced)
    message = ctx.pool.take(total, pieces[0][0].device)
    staged = ctx.meter.hold(total)
    for (tensor, _), slot in zip(pieces, slots, strict=True):
        slot_view(message, slot).copy_(tensor)
    ctx.meter.release(produced)
    return Outgoing(peer, message, staged, pooled=True)


def _landing(ctx: ExecContext, op: TransferOp) -> tuple[Landing, list[tuple[tuple[int, ...], torch.dtype]]]:
    transform = ctx.transforms.get(op.name)
    if transform is None:
        target = ctx.dst_view(op)
        landing = Landing(op, [], target, None, target.device)
        return landing, [(tuple(op.sizes), ctx.wire_dtype(op.name))]
    buffers = list(transform.prepare_recv(op.name, op))
    device = buffers[0].device if buffers else torch.device("cpu")
    return Landing(op, [], None, buffers, device), [(tuple(b.shape), b.dtype) for b in buffers]


def contiguous_span(tensors: list[torch.Tensor], slots: list[Slot], total: int) -> torch.Tensor | None:
    """The memory of ``tensors`` as one message, when they already sit where ``slots`` put them.

    That is: every tensor contiguous and non-empty, all in one storage, tensor ``i`` starting
    ``slots[i].offset`` bytes after the first. One tensor is returned as is; several as a flat uint8
    view of the storage range they cover (``total`` bytes). None when any condition fails.
    """
    first = tensors[0]
    if len(tensors) == 1:
        return first if first.is_contiguous() and first.nbytes == total else None
    storage = first.untyped_storage()
    base = first.data_ptr()
    for tensor, slot in zip(tensors, slots, strict=True):
        if not tensor.is_contiguous() or tensor.nbytes == 0 or tensor.device != first.device:
            return None
        if tensor.data_ptr() - base != slot.offset:
            return None
        if tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
    span = torch.empty(0, dtype=torch.uint8, device=first.device)
    return span.set_(storage, base - storage.data_ptr(), (total,), (1,))


def _direct_target(
    landings: list[Landing], slots: list[Slot], total: int, dtype_of
) -> torch.Tensor | None:
    """The tensor to receive into without staging: the destination regions themselves when they lie
    as the message's slots do, or a transform's single receive buffer."""
    if any(landing.buffers is not None for landing in landings):
        if len(landings) != 1 or len(slots) != 1:
            return None
        buffer = landings[0].buffers[0]
        return buffer if buffer.is_contiguous() else None
    if any(landing.target.dtype != dtype_of(landing.op.name) for landing in landings):
        return None
    return contiguous_span([landing.target for landing in landings], slots, total)


def build_incoming(ctx: ExecContext, peer: int, ops: list[TransferOp]) -> Incoming | None:
    """Prepare the one message expected from ``peer`` in a batch (None when it has no bytes)."""
    pairs = [_landing(ctx, op) for op in ops]
    landings = [landing for landing, _ in pairs]
    slots, total = layout_slots([spec for _, specs in pairs for spec in specs])
    if total == 0:
        return None
    position = 0
    for landing, specs in pairs:
        landing.slots, position = slots[position : position + len(specs)], position + len(specs)
    direct = _direct_target(landings, slots, total, ctx.wire_dtype)
    if direct is not None:
        return Incoming(peer, direct, landings, True, ctx.meter.hold(_buffer_bytes(landings)))
    for landing in landings:  # packed: the transform gets views of the message instead
        landing.buffers = None
    message = ctx.pool.take(total, landings[0].device)
    return Incoming(peer, message, landings, False, ctx.meter.hold(total))


def _buffer_bytes(landings: list[Landing]) -> int:
    return sum(b.nbytes for landing in landings for b in (landing.buffers or ()))


def land(ctx: ExecContext, incoming: Incoming) -> None:
    """Unpack a completed message: one copy per op (cast if asked), or the transform's finalize_recv."""
    for landing in incoming.landings:
        if incoming.direct:
            views = [incoming.message]
        else:
            views = [slot_view(incoming.message, slot) for slot in landing.slots]
        if landing.target is None:
            ctx.transforms[landing.op.name].finalize_recv(landing.op.name, landing.op, views)
        elif not incoming.direct:
            landing.target.copy_(views[0])


def run_local(ctx: ExecContext, op: TransferOp) -> int:
    """Copy one LOCAL op view to view (or through its transform); return the logical bytes."""
    view = ctx.src_view(op)
    transform = ctx.transforms.get(op.name)
    if transform is None:
        ctx.dst_view(op).copy_(view)
    else:
        wire = transform.prepare_send(op.name, op, view)
        held = ctx.meter.hold(sum(t.nbytes for t in wire))
        transform.finalize_recv(op.name, op, wire)
        ctx.meter.release(held)
    return op.numel * ctx.plan.tensors[op.name].dtype.itemsize
