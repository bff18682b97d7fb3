"""``execute_plan``: run one rank's ``RankPlan`` over a ``CopyService``, writing destinations in place.

Batches are launched in plan order. Launching a batch posts its receives first (a Gloo send does
not move until its receive is posted), then packs and posts its sends: one message per peer per
batch (``messages.py``), which goes without staging when its slices already lie in memory as the
message would hold them. While it is on the wire the batch's LOCAL ops run. Earlier batches stay in
flight while the staging they hold is at most ``window`` bytes (default 0): batches moved without
staging cost nothing to keep in flight, so the wire never waits for them; a staged batch is retired
(waited for, unpacked, ``finalize_tensor`` called for transformed tensors it finished, its staging
released) once the next batch is launched, so staging holds at most two batches at once.
``ExecStats.peak_staging_bytes`` reports what was held.

Transports with a ``start()`` returning a handle with ``wait()`` (``P2PCopyService`` and its
subclasses) get that overlap; others are driven through ``run()``, one batch at a time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import TransportError
from ..plan.ops import RankPlan
from ..transform import ReshardTransform, assign_transforms
from ..transport.copy_service import CopyService
from .check import check_inputs
from .messages import ExecContext, Incoming, Outgoing, build_incoming, build_outgoing, land, run_local
from .pool import StagingPool, pool_for
from .schedule import Batch, finalize_points, first_points, message_task_id, split_batches
from .stats import ExecStats


@dataclass
class Prepared:
    """A batch ready to go on the wire."""

    batch: Batch
    outgoing: list[Outgoing]
    incoming: list[Incoming]


@dataclass
class Flight:
    """A launched batch: its messages and the transport handles still to wait for."""

    prepared: Prepared
    waits: list[Callable[[], None]] = field(default_factory=list)

    @property
    def staged(self) -> int:
        """Staging bytes its messages hold until it is retired."""
        return sum(m.staged for m in (*self.prepared.incoming, *self.prepared.outgoing))


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
    window: int = 0,
) -> ExecStats:
    """Execute ``plan`` on this rank; collective with every peer the plan names.

    ``src_tensors`` / ``dst_tensors`` map logical names to this rank's local tensors (a name this
    rank does not hold may be absent). Destination tensors are written in place, never replaced. The
    wire carries each untransformed tensor in the plan's dtype (``plan.tensors[name].dtype``); a
    local tensor of another dtype is an error unless ``cast=True``, which converts while packing and
    unpacking. ``transform``: one transform or several (each name claimed by at most one); a name a
    transform owns needs no destination tensor. ``pool``: staging buffers to reuse across refits
    (default: a pool kept with ``plan`` while it lives, see ``pool_for``; pass ``StagingPool()`` for
    fresh buffers). Inputs are
    checked before any data moves (``PlanError``); transport failures raise ``TransportError``
    naming the rank, batch and peer.
    """
    started = time.perf_counter()
    owners = assign_transforms(transform, plan.tensors)
    check_inputs(plan, src_tensors, dst_tensors, owners, cast=cast, device=transport.device)
    pool = pool if pool is not None else pool_for(plan)
    ctx = ExecContext(plan, src_tensors, dst_tensors, owners, pool=pool)
    batches = split_batches(plan)
    ctx.stats.batches = len(batches)
    _pipeline(ctx, batches, transport, window)
    ctx.stats.peak_staging_bytes = ctx.meter.peak
    ctx.stats.seconds_total = time.perf_counter() - started
    return ctx.stats


def _pipeline(ctx: ExecContext, batches: list[Batch], transport: CopyService, window: int) -> None:
    """Launch batches in order, keeping earlier ones on the wire while they hold little staging.

    After batch i is launched its LOCAL ops run, then earlier batches are retired (waited for,
    landed, their staging released) oldest first while the staging they hold exceeds ``window``
    bytes. Batches that went without staging (contiguous slices) cost nothing to keep in flight, so
    the wire stays busy across them; packed batches are double-buffered (``window=0``).
    """
    finals = finalize_points(ctx.plan, ctx.transforms)
    firsts = first_points(ctx.plan, ctx.transforms)
    flying: deque[Flight] = deque()
    held = 0  # staging held by the flights launched before the newest one
    try:
        for batch in batches:
            held += flying[-1].staged if flying else 0
            flying.append(_launch(ctx, batch, firsts, transport))
            _run_locals(ctx, batch)
            while len(flying) > 1 and held > window:
                _retire(ctx, flying[0], finals)
                held -= flying.popleft().staged
        while flying:
            _retire(ctx, flying[0], finals)
            flying.popleft()
    except BaseException as exc:
        _settle(flying, give_up=isinstance(exc, TransportError))
        raise


def _launch(
    ctx: ExecContext, batch: Batch, firsts: Mapping[int, list[str]], transport: CopyService
) -> Flight:
    """Post the batch's receives, then pack and post its sends (a peer's send waits for our receive)."""
    flight = Flight(Prepared(batch, [], []), [])
    rank, index = ctx.plan.rank, batch.index
    with ctx.stats.timed("pack"):
        for name in firsts.get(index, ()):
            ctx.meter.hold(ctx.transforms[name].transient_bytes(name))
        flight.prepared.incoming = _present(build_incoming(ctx, p, ops) for p, ops in batch.recvs.items())
    start = getattr(transport, "start", None)
    with ctx.stats.timed("transfer"):
        for inc in flight.prepared.incoming:
            transport.submit_recv(inc.message, inc.peer, message_task_id(index, inc.peer, rank))
            ctx.stats.bytes_received += inc.message.nbytes
        ctx.stats.messages_received += len(flight.prepared.incoming)
        if callable(start) and flight.prepared.incoming:
            flight.waits.append(start().wait)
    with ctx.stats.timed("pack"):
        flight.prepared.outgoing = _present(build_outgoing(ctx, p, ops) for p, ops in batch.sends.items())
    with ctx.stats.timed("transfer"):
        for out in flight.prepared.outgoing:
            transport.submit_send(out.message, out.peer, message_task_id(index, rank, out.peer))
            ctx.stats.bytes_sent += out.message.nbytes
        ctx.stats.messages_sent += len(flight.prepared.outgoing)
        if not callable(start):
            transport.run()
        elif flight.prepared.outgoing:
            flight.waits.append(start().wait)
    return flight


def _present(messages: Iterable) -> list:
    """The messages that exist (a peer's message with no bytes is None)."""
    return [m for m in messages if m is not None]


def _retire(ctx: ExecContext, flight: Flight, finals: Mapping[int, list[str]]) -> None:
    """Wait for a launched batch, then land it and release its staging."""
    with ctx.stats.timed("transfer"):
        while flight.waits:
            wait = flight.waits.pop(0)
            try:
                wait()
            except TransportError as exc:
                where = f"rank {ctx.plan.rank}, batch {flight.prepared.batch.index}"
                raise TransportError(f"{where}: {exc}") from exc
    _land_batch(ctx, flight.prepared, finals.get(flight.prepared.batch.index, ()))


def _settle(flying: Iterable[Flight], *, give_up: bool) -> None:
    """After an error: let the peers finish what is in flight (or, after a transport failure, give
    it up at once so no rank waits out a timeout per batch); the original error is what propagates."""
    for flight in flying:
        for wait in flight.waits:
            if not give_up:
                try:
                    wait()
                    continue
                except Exception:
                    give_up = True
            abandon = getattr(getattr(wait, "__self__", None), "abandon", None)
            if callable(abandon):
                try:
                    abandon()
                except Exception:
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
