"""``execute_plan``: run one rank's ``RankPlan`` over a ``CopyService``, writing destinations in place.

Per batch: pack one message per peer (``messages.py``), submit all sends and receives and start the
round; while it is on the wire, land the previous batch (and call ``finalize_tensor`` for transformed
tensors it finished), run this batch's LOCAL ops and pack the next batch; then wait. Staging can so
hold up to three batches at once (landing, in flight, packed); ``ExecStats.peak_staging_bytes``
reports what was held.
Transports with a ``start()`` returning a handle with ``wait()`` (``P2PCopyService`` and its
subclasses) get that overlap; others are driven through ``run()`` without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ..errors import TransportError
from ..plan.ops import RankPlan
from ..transform import ReshardTransform, assign_transforms
from ..transport.copy_service import CopyService
from .check import check_inputs
from .messages import ExecContext, Incoming, Outgoing, build_incoming, build_outgoing, land, run_local
from .pool import StagingPool
from .schedule import Batch, finalize_points, first_points, message_task_id, split_batches
from .stats import ExecStats


@dataclass
class Prepared:
    """A batch ready to go on the wire."""

    batch: Batch
    outgoing: list[Outgoing]
    incoming: list[Incoming]


@torch.no_grad()  # destinations are often leaf Parameters that require grad; we write their data
def execute_plan(
    plan: RankPlan,
    src_tensors: Mapping[str, torch.Tensor | None],
    dst_tensors: Mapping[str, torch.Tensor | None],
    transport: CopyService,
    *,
    transform: ReshardTransform | Iterable[ReshardTransform] | None = None,
    cast: bool = False,
    pool: StagingPool | None = None,
) -> ExecStats:
    """Execute ``plan`` on this rank; collective with every peer the plan names.

    ``src_tensors`` / ``dst_tensors`` map logical names to this rank's local tensors (a name this
    rank does not hold may be absent). Destination tensors are written in place, never replaced. The
    wire carries each untransformed tensor in the plan's dtype (``plan.tensors[name].dtype``); a
    local tensor of another dtype is an error unless ``cast=True``, which converts while packing and
    unpacking. ``transform``: one transform or several (each name claimed by at most one); a name a
    transform owns needs no destination tensor. ``pool``: staging buffers to reuse (pass the same
    pool to every refit of a plan to skip re-allocating them; default: fresh buffers). Inputs are
    checked before any data moves (``PlanError``); transport failures raise ``TransportError``
    naming the rank, batch and peer.
    """
    started = time.perf_counter()
    owners = assign_transforms(transform, plan.tensors)
    check_inputs(plan, src_tensors, dst_tensors, owners, cast=cast, device=transport.device)
    ctx = ExecContext(plan, src_tensors, dst_tensors, owners, pool=pool or StagingPool())
    batches = split_batches(plan)
    ctx.stats.batches = len(batches)
    _pipeline(ctx, batches, transport)
    ctx.stats.peak_staging_bytes = ctx.meter.peak
    ctx.stats.seconds_total = time.perf_counter() - started
    return ctx.stats


def _pipeline(ctx: ExecContext, batches: list[Batch], transport: CopyService) -> None:
    """Keep the wire busy: while batch i is in flight, land batch i-1, run i's LOCAL ops, pack i+1."""
    finals = finalize_points(ctx.plan, ctx.transforms)
    firsts = first_points(ctx.plan, ctx.transforms)
    ready = _prepare(ctx, batches[0], firsts) if batches else None
    landed_last: Prepared | None = None
    for i, batch in enumerate(batches):
        current = ready
        wait = _launch(ctx, current, transport)
        try:
            if landed_last is not None:
                _land_batch(ctx, landed_last, finals.get(landed_last.batch.index, ()))
            _run_locals(ctx, batch)
            ready = _prepare(ctx, batches[i + 1], firsts) if i + 1 < len(batches) else None
        except BaseException:
            _drain(wait)  # let the peers finish this round before the error propagates
            raise
        _wait(ctx, batch, wait)
        landed_last = current
    if landed_last is not None:
        _land_batch(ctx, landed_last, finals.get(landed_last.batch.index, ()))


def _prepare(ctx: ExecContext, batch: Batch, firsts: Mapping[int, list[str]]) -> Prepared:
    with ctx.stats.timed("pack"):
        for name in firsts.get(batch.index, ()):
            ctx.meter.hold(ctx.transforms[name].transient_bytes(name))
        outgoing = [build_outgoing(ctx, peer, ops) for peer, ops in batch.sends.items()]
        incoming = [build_incoming(ctx, peer, ops) for peer, ops in batch.recvs.items()]
    return Prepared(batch, [m for m in outgoing if m], [m for m in incoming if m])


def _launch(ctx: ExecContext, prepared: Prepared, transport: CopyService) -> Callable[[], None]:
    rank, index = ctx.plan.rank, prepared.batch.index
    with ctx.stats.timed("transfer"):
        for out in prepared.outgoing:
            transport.submit_send(out.message, out.peer, message_task_id(index, rank, out.peer))
            ctx.stats.bytes_sent += out.message.nbytes
        for inc in prepared.incoming:
            transport.submit_recv(inc.message, inc.peer, message_task_id(index, inc.peer, rank))
            ctx.stats.bytes_received += inc.message.nbytes
        ctx.stats.messages_sent += len(prepared.outgoing)
        ctx.stats.messages_received += len(prepared.incoming)
        start = getattr(transport, "start", None)
        if callable(start):
            return start().wait
        transport.run()
        return lambda: None


def _wait(ctx: ExecContext, batch: Batch, wait: Callable[[], None]) -> None:
    with ctx.stats.timed("transfer"):
        try:
            wait()
        except TransportError as exc:
            raise TransportError(f"rank {ctx.plan.rank}, batch {batch.index}: {exc}") from exc


def _drain(wait: Callable[[], None]) -> None:
    try:
        wait()
    except Exception:  # the original error is the one to report
        pass


def _run_locals(ctx: ExecContext, batch: Batch) -> None:
    with ctx.stats.timed("local"):
        for op in batch.local:
            ctx.stats.bytes_local += run_local(ctx, op)


def _land_batch(ctx: ExecContext, prepared: Prepared, finished: Iterable[str]) -> None:
    with ctx.stats.timed("unpack"):
        for message in (*prepared.incoming, *prepared.outgoing):
            if isinstance(message, Incoming):
                land(ctx, message)
            ctx.meter.release(message.staged)
            if message.pooled:
                ctx.pool.give(message.message)
        for name in finished:
            ctx.transforms[name].finalize_tensor(name)
            ctx.meter.release(ctx.transforms[name].transient_bytes(name))
