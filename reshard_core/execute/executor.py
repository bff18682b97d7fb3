"""``execute_plan``: run one rank's ``RankPlan`` over a ``CopyService``, writing destinations in place.

Batches are launched in plan order. Launching a batch posts its receives first (a Gloo send does
not move until its receive is posted), then packs and posts its sends. Between a pair of ranks in a
batch, the small slices share one packed message and every slice of at least ``DIRECT_MIN_BYTES``
is a message of its own (``schedule.message_groups``); a message goes without staging on each side
where its slices already lie in memory as the message holds them (``messages.py``), so a large
contiguous slice is sent from the source and received into the destination. On a transport with
``independent_rounds`` (Gloo) each message is its own round: receives land as they arrive and each
send is on the wire while the next is packed. While the batch is on the wire its LOCAL ops run.

A batch is retired (waited for, unpacked, ``finalize_tensor`` called for transformed tensors it
finished, its staging released) as soon as the staging held by earlier batches exceeds ``window``
bytes (default 0: staged batches are double-buffered, so staging holds at most two batches) or it
finishes a transformed tensor. Batches whose messages all moved in place hold nothing and stay in
flight, so a rank never stops packing, copying or launching to wait for them.
``ExecStats.peak_staging_bytes`` reports what was held.

Every transport is driven through ``CopyService.start()`` (the overlapping mode): those that
override it (``P2PCopyService`` and its subclasses, NVSHMEM) get that overlap; for the others the
default runs the batch inside ``start()``, one batch at a time.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import TransportError
from ..plan.ops import RankPlan
from ..transform import ReshardTransform, assign_transforms
from ..transport.copy_service import CopyService
from ..transport.task_ids import message_task_id
from . import delta as deltas
from .delta_state import DeltaState, stamp
from .input_checks import check_inputs
from .memo import ExecMemo
from .messages import ExecContext, Incoming, Outgoing, build_incoming, build_outgoing, land, run_local
from .pool import StagingPool, pool_for
from .schedule import Batch, Schedule, build_schedule
from .side_round import exchange_device
from .stats import ExecStats
from .verify import Verifier

_MAX_LIGHT = 256
"""Batches kept in flight at most (bounds outstanding transport requests)."""


@dataclass
class Prepared:
    """A batch ready to go on the wire."""

    batch: Batch
    outgoing: list[Outgoing]
    incoming: list[Incoming]


@dataclass
class Flight:
    """A launched batch. ``waits`` pairs each transport handle still to wait for with the messages
    it completes (a transport without overlap completed them inside ``start()``)."""

    prepared: Prepared
    waits: list[tuple[list[Incoming | Outgoing], Callable[[], None]]] = field(default_factory=list)
    heavy: bool = False
    """Holds staging or finishes a transformed tensor: retired as soon as the window asks."""

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
    memo: ExecMemo | None = None,
    verify: bool = False,
    delta: DeltaState | None = None,
) -> ExecStats:
    """Execute ``plan`` on this rank; collective with every peer the plan names.

    ``src_tensors`` / ``dst_tensors`` map logical names to this rank's local tensors (a name this
    rank does not hold may be absent). Destination tensors are written in place, never replaced. The
    wire carries each untransformed tensor in the plan's dtype (``plan.tensors[name].dtype``); a
    local tensor of another dtype is an error unless ``cast=True``, which converts while packing and
    unpacking. ``transform``: one transform or several (each name claimed by at most one); a name a
    transform owns needs no destination tensor. ``pool``: staging buffers to reuse across refits
    (default: a pool kept with ``plan`` while it lives, see ``pool_for``; pass ``StagingPool()`` for
    fresh buffers). ``window``: staging bytes that earlier batches may keep on the wire while later
    ones are packed and launched (0: staged batches are double-buffered; batches moved in place
    never count). ``memo``: what executions of this plan on these same tensors may reuse (the
    input check's verdict, the schedule, region views, message recipes; see ``ExecMemo`` for the
    promise it takes). ``verify``: the sender digests each op's bytes in its message, the receiver
    digests what it wrote and, after the last batch, the digests cross (one small message per pair
    and direction; every peer of the plan must pass the same ``verify``); ``ExecStats`` then counts
    what was checked and lists ``mismatches``, which this call does not raise: ``verify.
    raise_mismatches`` makes every rank raise them (see ``verify.py``). Without it nothing of
    this runs. ``delta``: the state a session keeps between delta executions (``delta.py``): only
    changed words then cross the wire, after two small rounds with every peer (every peer of the
    plan must pass one; ``ExecStats.delta`` reports it). Without it, this call marks the
    destinations as written by a non-delta execution, so a later delta one sends them whole.
    Inputs are checked before any data moves (``PlanError``); transport
    failures, and any other error raised inside the transport's code, raise ``TransportError``
    prefixed once with the transport and the plugin providing it (``transport 'gloo' (plugin
    reshard-gloo): rank 1, batch 0: gloo: recv from rank 0 ... failed: ...``).
    """
    started = time.perf_counter()
    owners = assign_transforms(transform, plan.tensors)
    memo = memo if memo is not None else ExecMemo()
    memo.bind(plan)
    if (cast, transport.device) not in memo.checked:
        check_inputs(plan, src_tensors, dst_tensors, owners, cast=cast, device=transport.device)
        memo.checked.add((cast, transport.device))
    pool = pool if pool is not None else pool_for(plan)
    ctx = ExecContext(
        plan, src_tensors, dst_tensors, owners, pool=pool, views=memo.views, recipes=memo.recipes
    )
    names = frozenset(owners)
    schedule = memo.schedules.get(names)
    if schedule is None:
        schedule = memo.schedules[names] = build_schedule(plan, names)
    ctx.stats.batches = len(schedule.batches)
    if verify:
        ctx.verify = Verifier(plan, exchange_device(transport))
    if delta is None:
        stamp(dst_tensors, 0)
    else:
        ctx.delta = deltas.DeltaRun(delta, ctx, schedule)
    try:
        if ctx.delta is not None:
            with ctx.stats.timed("pack"):
                ctx.delta.begin(transport)
        _pipeline(ctx, schedule, transport, window)
        if ctx.verify is not None:
            ctx.verify.finish(transport, ctx.stats)
        if ctx.delta is not None:
            ctx.delta.finish()
            ctx.stats.delta = ctx.delta.stats()
    except Exception as exc:
        if delta is not None:
            delta.invalidate()
        named = _named_transport_error(exc, transport)
        if named is None:
            raise
        raise named from exc
    ctx.stats.peak_staging_bytes = ctx.meter.peak
    ctx.stats.seconds_total = time.perf_counter() - started
    return ctx.stats


def _pipeline(ctx: ExecContext, schedule: Schedule, transport: CopyService, window: int) -> None:
    """Launch batches in order; retire a batch early only when it holds staging or transform state.

    After batch i is launched its LOCAL ops run. Then, while the staging held by earlier batches
    exceeds ``window`` bytes, the oldest batch holding any is retired (waited for, unpacked, its
    staging released). Batches that hold nothing (every message moved in place) stay in flight
    until the end, up to ``_MAX_LIGHT`` of them, so waiting for them never stalls packing, local
    copies or later launches. Batches that finish transformed tensors are retired in order.
    """
    finals = schedule.finals
    flying: list[Flight] = []  # launch order
    try:
        for batch in schedule.batches:
            try:
                flight = _launch(ctx, batch, schedule, transport)
            except TransportError as exc:  # a peer gone before this batch even started
                raise TransportError(f"rank {ctx.plan.rank}, batch {batch.index}: {exc}") from exc
            flight.heavy = flight.staged > 0 or batch.index in finals
            _run_locals(ctx, batch)
            while True:
                held = [f for f in flying if f.heavy]
                if not held or (sum(f.staged for f in held) <= window and not _finishes(held, finals)):
                    break
                _retire(ctx, held[0], finals)
                flying.remove(held[0])
            flying.append(flight)
            if len(flying) > _MAX_LIGHT:
                _retire(ctx, flying[0], finals)
                del flying[0]
        while flying:
            _retire(ctx, flying[0], finals)
            del flying[0]
    except BaseException as exc:
        _settle(flying, give_up=isinstance(exc, TransportError))
        raise


def _named_transport_error(exc: Exception, transport: CopyService) -> TransportError | None:
    """``exc`` as a ``TransportError`` prefixed once with the transport and the plugin providing it
    (``transport 'gloo' (plugin reshard-gloo): ...``), when it is a ``TransportError`` or was raised
    inside the transport's own code; None for any other error (the executor's, a transform's)."""
    if not isinstance(exc, TransportError) and not _raised_in(exc, type(transport)):
        return None
    from ..transport.registry import transport_label

    text = str(exc) if isinstance(exc, TransportError) else f"{type(exc).__name__}: {exc}"
    return TransportError(f"{transport_label(type(transport))}: {text}")


def _raised_in(exc: BaseException, cls: type) -> bool:
    """Whether ``exc`` passed through code of a module defining ``cls`` or one of its bases."""
    files = set()
    for base in cls.__mro__:
        if isinstance(base, type) and issubclass(base, CopyService):
            try:
                files.add(inspect.getfile(base))
            except (TypeError, OSError):
                pass
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in files:
            return True
        tb = tb.tb_next
    return False


def _finishes(flights: list[Flight], finals: Mapping[int, list[str]]) -> bool:
    """Whether any of ``flights`` finishes a transformed tensor (retired promptly, in order)."""
    return any(f.prepared.batch.index in finals for f in flights)


def _launch(ctx: ExecContext, batch: Batch, schedule: Schedule, transport: CopyService) -> Flight:
    """Post the batch's receives, then pack and post its sends (a Gloo send moves only once the
    peer posted the matching receive). On a transport with ``independent_rounds`` every message is
    its own round, started as soon as it is ready (receives land as they arrive, each send goes
    while the next is packed); otherwise the batch is one round."""
    flight = Flight(Prepared(batch, [], []))
    with ctx.stats.timed("pack"):
        for name in schedule.firsts.get(batch.index, ()):
            ctx.meter.hold(ctx.transforms[name].transient_bytes(name))
    rank, index = ctx.plan.rank, batch.index
    for peer, seq, ops in schedule.receives[index]:
        incoming = _incoming(ctx, (index, peer, seq), ops)
        if incoming is not None:
            _post(ctx, flight, transport, incoming, message_task_id(index, peer, rank, seq))
    for peer, seq, ops in schedule.sends[index]:
        outgoing = _outgoing(ctx, (index, peer, seq), ops)
        if outgoing is not None:
            _post(ctx, flight, transport, outgoing, message_task_id(index, rank, peer, seq))
    messages = [*flight.prepared.incoming, *flight.prepared.outgoing]
    if not transport.independent_rounds and messages:
        with ctx.stats.timed("transfer"):
            flight.waits.append((messages, transport.start().wait))
    return flight


def _incoming(ctx: ExecContext, key: tuple[int, int, int], ops: list) -> Incoming | None:
    """The receive of message ``key`` (batch, peer, seq): delta's encoded one, else the plain one."""
    with ctx.stats.timed("pack"):
        incoming = ctx.delta.incoming(key, ops) if ctx.delta is not None else None
        if incoming is None:
            incoming = build_incoming(ctx, key[1], ops)
    if incoming is not None and ctx.verify is not None:
        ctx.verify.expect(key[1], ops, incoming)
    return incoming


def _outgoing(ctx: ExecContext, key: tuple[int, int, int], ops: list) -> Outgoing | None:
    """The send of message ``key`` (batch, peer, seq), packed: delta's encoded one, else the plain one."""
    with ctx.stats.timed("pack"):
        outgoing = ctx.delta.outgoing(key) if ctx.delta is not None else None
        return outgoing if outgoing is not None else build_outgoing(ctx, key[1], ops)


def _post(
    ctx: ExecContext, flight: Flight, transport: CopyService, message: Incoming | Outgoing, task: int
) -> None:
    """Submit one message and count it; on a transport with ``independent_rounds`` it is a round of
    its own, started now."""
    with ctx.stats.timed("transfer"):
        if isinstance(message, Incoming):
            transport.submit_recv(message.message, message.peer, task)
            ctx.stats.bytes_received += message.message.nbytes
            ctx.stats.messages_received += 1
            flight.prepared.incoming.append(message)
        else:
            transport.submit_send(message.message, message.peer, task)
            ctx.stats.bytes_sent += message.message.nbytes
            ctx.stats.messages_sent += 1
            flight.prepared.outgoing.append(message)
        if transport.independent_rounds:
            flight.waits.append(([message], transport.start().wait))


def _retire(ctx: ExecContext, flight: Flight, finals: Mapping[int, list[str]]) -> None:
    """Wait for a launched batch, landing each received message as soon as it arrived; then
    release the staging of what was sent and finalize the transformed tensors it finished."""
    pending = {id(m) for m in (*flight.prepared.incoming, *flight.prepared.outgoing)}
    while flight.waits:
        messages, wait = flight.waits.pop(0)
        with ctx.stats.timed("transfer"):
            try:
                wait()
            except TransportError as exc:
                where = f"rank {ctx.plan.rank}, batch {flight.prepared.batch.index}"
                raise TransportError(f"{where}: {exc}") from exc
        _land(ctx, messages)
        pending.difference_update(id(m) for m in messages)
    _land(ctx, [m for m in (*flight.prepared.incoming, *flight.prepared.outgoing) if id(m) in pending])
    with ctx.stats.timed("unpack"):
        for name in finals.get(flight.prepared.batch.index, ()):
            ctx.transforms[name].finalize_tensor(name)
            ctx.meter.release(ctx.transforms[name].transient_bytes(name))


def _land(ctx: ExecContext, messages: Iterable[Incoming | Outgoing]) -> None:
    """Unpack completed received messages; release the staging of completed messages."""
    with ctx.stats.timed("unpack"):
        for message in messages:
            if isinstance(message, Incoming):
                if ctx.verify is None:
                    land(ctx, message)
                else:
                    ctx.verify.land(ctx, message)  # lands it, then digests what it wrote
            ctx.meter.release(message.staged)
            if message.pooled:
                ctx.pool.give(message.message)


def _settle(flying: Iterable[Flight], *, give_up: bool) -> None:
    """After an error: let the peers finish what is in flight (or, after a transport failure, give
    it up at once so no rank waits out a timeout per batch); the original error is what propagates."""
    for flight in flying:
        for _, wait in flight.waits:
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
            if ctx.verify is not None:
                ctx.verify.local(ctx, op)
