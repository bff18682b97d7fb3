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

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..plan.ops import RankPlan, TransferOp
from ..transform import ReshardTransform
from ..views import copy_into, materialize, region
from .input_checks import source_name
from .pool import StagingPool
from .slots import Slot, layout_slots, slot_view
from .stats import ExecStats, StagingMeter

if TYPE_CHECKING:
    from .features import DeltaFeature, VerifyFeature


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
    recipes: dict[tuple[int, str], Recipe] = field(default_factory=dict)
    """Untransformed messages' recipes by ``(id(ops), direction)``, kept by an ``ExecMemo``."""
    verify: VerifyFeature | None = None
    """Set when the execution verifies arrivals (``verify.Verifier``); None keeps the data path bare."""
    delta: DeltaFeature | None = None
    """Set for a delta execution (``delta.DeltaRun``): the messages it prepared and the sizes announced."""

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

    recipe: Recipe | None = None
    """Set for an untransformed message: ``land`` unpacks by it (``landings`` is then empty)."""
    lander: Callable[[Incoming], None] | None = None
    """Set when ``message`` is not the data itself (a delta against what the destination holds):
    ``land`` hands it to this instead of unpacking it."""

    @property
    def pooled(self) -> bool:
        return not self.direct


@dataclass(frozen=True)
class Recipe:
    """How one message without transformed ops travels; fixed while the plan and tensors are (so an
    ``ExecMemo`` keeps it). ``direct``: the memory that goes on the wire as is (the source regions to
    send, or the destination regions to receive into), None when the message is staged; ``pieces``:
    each op's region view and its slot in a staging buffer of ``nbytes``."""

    direct: torch.Tensor | None
    pieces: tuple[tuple[torch.Tensor, Slot], ...]
    nbytes: int


def recipe_of(ctx: ExecContext, ops: list[TransferOp], direction: str) -> Recipe:
    """The (memoized) recipe of a message of untransformed ops; ``direction``: "send" or "recv"."""
    key = (id(ops), direction)
    found = ctx.recipes.get(key)
    if found is None:
        view = ctx.src_view if direction == "send" else ctx.dst_view
        views = [view(op) for op in ops]
        wire = [ctx.wire_dtype(op.name) for op in ops]
        slots, total = layout_slots([(tuple(op.sizes), dtype) for op, dtype in zip(ops, wire, strict=True)])
        direct = None
        if total and all(v.dtype == dtype for v, dtype in zip(views, wire, strict=True)):
            direct = contiguous_span(views, slots, total)
        found = ctx.recipes[key] = Recipe(direct, tuple(zip(views, slots, strict=True)), total)
    return found


def _transformed(ctx: ExecContext, ops: list[TransferOp]) -> bool:
    return bool(ctx.transforms) and any(op.name in ctx.transforms for op in ops)


def _send_pieces(ctx: ExecContext, op: TransferOp) -> tuple[list[tuple[torch.Tensor, torch.dtype]], int]:
    """The wire tensors of one SEND op with the dtype each travels in, and the bytes freshly produced."""
    view = ctx.src_view(op)
    transform = ctx.transforms.get(op.name)
    if transform is None:
        return [(view, ctx.wire_dtype(op.name))], 0
    wire = transform.prepare_send(op.name, op, materialize(view))
    return [(t, t.dtype) for t in wire], sum(t.nbytes for t in wire)


def build_outgoing(ctx: ExecContext, peer: int, ops: list[TransferOp]) -> Outgoing | None:
    """Pack every SEND op to ``peer`` of one batch into one message (None when it has no bytes).
    With ``ctx.verify``, each op's bytes in the packed message are digested (``verify.py``)."""
    if not _transformed(ctx, ops):
        recipe = recipe_of(ctx, ops, "send")
        if recipe.direct is not None or recipe.nbytes == 0:
            out = Outgoing(peer, recipe.direct, 0) if recipe.nbytes else None
        else:
            message = ctx.pool.take(recipe.nbytes, recipe.pieces[0][0].device)
            for view, slot in recipe.pieces:
                copy_into(slot_view(message, slot), view)
            out = Outgoing(peer, message, ctx.meter.hold(recipe.nbytes), pooled=True)
        if out is not None and ctx.verify is not None:
            ctx.verify.sent(peer, out.message, [[slot] for _, slot in recipe.pieces])
        return out
    pieces: list[tuple[torch.Tensor, torch.dtype]] = []
    counts: list[int] = []
    produced = 0
    for op in ops:
        more, nbytes = _send_pieces(ctx, op)
        pieces += more
        counts.append(len(more))
        produced += ctx.meter.hold(nbytes)
    slots, total = layout_slots([(tuple(t.shape), dtype) for t, dtype in pieces])
    if total == 0:
        ctx.meter.release(produced)
        return None
    span = None
    if all(t.dtype == dtype for t, dtype in pieces):
        span = contiguous_span([t for t, _ in pieces], slots, total)
    if span is not None:
        out = Outgoing(peer, span, produced)
    else:
        message = ctx.pool.take(total, pieces[0][0].device)
        staged = ctx.meter.hold(total)
        for (tensor, _), slot in zip(pieces, slots, strict=True):
            copy_into(slot_view(message, slot), tensor)
        ctx.meter.release(produced)
        out = Outgoing(peer, message, staged, pooled=True)
    if ctx.verify is not None:
        bounds = itertools.pairwise([0, *itertools.accumulate(counts)])
        ctx.verify.sent(peer, out.message, [slots[start:end] for start, end in bounds])
    return out


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
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None  # a split region (``views.SplitRegion``) is never one stretch of memory
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


def _direct_target(landings: list[Landing], slots: list[Slot]) -> torch.Tensor | None:
    """The transform's receive buffer to receive into without staging: when the message is one op
    with one contiguous buffer. (Messages without transformed ops go by their ``Recipe``.)"""
    if len(landings) != 1 or len(slots) != 1:
        return None
    buffer = landings[0].buffers[0]
    return buffer if buffer.is_contiguous() else None


def build_incoming(ctx: ExecContext, peer: int, ops: list[TransferOp]) -> Incoming | None:
    """Prepare the one message expected from ``peer`` in a batch (None when it has no bytes)."""
    if not _transformed(ctx, ops):
        recipe = recipe_of(ctx, ops, "recv")
        if recipe.nbytes == 0:
            return None
        if recipe.direct is not None:
            return Incoming(peer, recipe.direct, [], True, 0, recipe)
        message = ctx.pool.take(recipe.nbytes, recipe.pieces[0][0].device)
        return Incoming(peer, message, [], False, ctx.meter.hold(recipe.nbytes), recipe)
    pairs = [_landing(ctx, op) for op in ops]
    landings = [landing for landing, _ in pairs]
    slots, total = layout_slots([spec for _, specs in pairs for spec in specs])
    if total == 0:
        return None
    position = 0
    for landing, specs in pairs:
        landing.slots, position = slots[position : position + len(specs)], position + len(specs)
    direct = _direct_target(landings, slots)
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
    if incoming.lander is not None:
        incoming.lander(incoming)
        return
    if incoming.recipe is not None:
        if not incoming.direct:
            for target, slot in incoming.recipe.pieces:
                copy_into(target, slot_view(incoming.message, slot))
        return
    for landing in incoming.landings:
        if incoming.direct:
            views = [incoming.message]
        else:
            views = [slot_view(incoming.message, slot) for slot in landing.slots]
        if landing.target is None:
            ctx.transforms[landing.op.name].finalize_recv(landing.op.name, landing.op, views)
        elif not incoming.direct:
            copy_into(landing.target, views[0])


def run_local(ctx: ExecContext, op: TransferOp) -> int:
    """Copy one LOCAL op view to view (or through its transform); return the logical bytes."""
    view = ctx.src_view(op)
    transform = ctx.transforms.get(op.name)
    if transform is None:
        copy_into(ctx.dst_view(op), view)
    else:
        wire = transform.prepare_send(op.name, op, materialize(view))
        held = ctx.meter.hold(sum(t.nbytes for t in wire))
        transform.finalize_recv(op.name, op, wire)
        ctx.meter.release(held)
    return op.numel * ctx.plan.tensors[op.name].dtype.itemsize
