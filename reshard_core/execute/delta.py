"""Delta refits (``refit(..., delta=True)``): only the 16-bit words that changed since the last
update a receiver confirmed cross the wire, encoded by ``delta_codec``.

A sender keeps a **snapshot** of every eligible message it sends: the message's bytes as the
receiver holds them once it applied it (memory: the bytes this rank sends per refit, on the
messages' device; ``DeltaStats.held_bytes``). A receiver keeps, per sender, the **id** of the last
update from that sender it applied in full. One delta execution:

1. **confirm**: each receiver sends each of its senders that id, or ``(0, 0)`` when it has none:
   its first delta refit, its last execution failed, or anything else wrote its destinations since
   (another session's refit, a refit without ``delta``; see ``stamp``);
2. **encode**: for a receiver whose confirmed id is the one the sender's snapshots stand at, each
   eligible message is diffed against its snapshot and goes as a delta when that is at most
   ``DENSE_RATIO`` of its dense bytes; every other message goes dense. Either way the snapshot
   becomes the message's new content, tagged with this update's id;
3. **announce**: each sender sends each receiver the update's id and, per message, the encoded
   size or -1 (dense); the receiver then knows every buffer to post;
4. the executor's pipeline runs as usual; a delta message lands by reading the destination's old
   words at the changed positions and writing the new ones (``delta_land``);
5. once every message from a sender landed, the receiver records that sender's update id.

So a snapshot is trusted only after its receiver confirmed it holds what the snapshot says: a failed
or partial apply, on either side, makes the next refit dense for that pair, and no update is ever
applied twice. Eligible: untransformed messages of at least ``MIN_BYTES`` whose wire dtypes all have
an even item size. With ``cast`` the sender diffs the packed (converted) message; the wire dtype is
the destination's, so receivers write words of their own dtype. Every rank of the plan must pass
the same ``delta`` (an agreed option).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ReshardError
from ..plan.describe import format_ranks
from ..plan.ops import TransferOp
from ..transport.copy_service import CopyService
from ..views import copy_into
from . import delta_codec
from .delta_land import land as land_delta
from .delta_state import (
    NO_BASELINE,
    NO_UPDATE_YET,
    REWRITTEN,
    DeltaState,
    DeltaStats,
    MessageKey,
    stamp,
    written_only_by,
)
from .messages import ExecContext, Incoming, Outgoing, recipe_of
from .schedule import Schedule
from .side_round import exchange_device, side_round
from .slots import layout_slots, slot_view

DENSE_RATIO = 0.5
"""A message goes as a delta only when its encoding is at most this share of its dense bytes: a
delta costs the receiver a gather and a scatter per changed word, a dense message one copy."""

TYPICAL_BYTES = 1.5
"""Bytes a changed word typically takes in a delta (1.4-1.7 on AdamW updates, ``docs/delta.md``):
a message whose changes would exceed ``DENSE_RATIO`` at this rate goes whole without encoding."""

MIN_BYTES = 1024
"""Smaller messages always go whole and keep no snapshot (a delta's header alone is 40 bytes)."""


class DeltaRun:
    """One delta execution on one rank: the rounds before the pipeline and the messages they
    prepared. The executor calls ``begin`` before its first batch, asks ``outgoing`` and
    ``incoming`` per message (an encoded one then lands by ``land``), and calls ``finish`` once
    every message landed."""

    def __init__(self, state: DeltaState, ctx: ExecContext, schedule: Schedule) -> None:
        self.state, self.ctx, self.schedule = state, ctx, schedule
        self.prepared: dict[MessageKey, Outgoing] = {}
        self.sizes: dict[MessageKey, int] = {}
        self.update: dict[int, tuple[int, int]] = {}  # per sender: the id it announced
        self.messages = self.dense = self.changed = self.compared = self.full = self.too_dense = 0
        self.notes: dict[str, list[int]] = {}
        """Why messages to some receivers went whole: reason -> those receivers."""

    # -- before the pipeline ------------------------------------------------------------------------

    def begin(self, transport: CopyService) -> None:
        """Confirm, encode and announce (module docstring, steps 1-3)."""
        state, ctx = self.state, self.ctx
        fresh = written_only_by(ctx.dst, state.serial)
        stamp(ctx.dst, state.serial)
        if not fresh:
            state.applied.clear()
            state.lost = REWRITTEN
        sends, recvs = self._messages("send"), self._messages("recv")
        baselines = {p: list(state.applied.get(p, (0, state.lost))) for p in recvs}
        confirmed = self._round(transport, 1, baselines, {p: 2 for p in sends})
        state.seq += 1
        update = (state.nonce, state.seq)
        announce = {}
        for peer, keys in sends.items():
            known = tuple(confirmed[peer]) == state.sent.get(peer, (-1, -1))
            if not known:
                self.notes.setdefault(self._why_full(peer, confirmed[peer]), []).append(peer)
            state.sent.pop(peer, None)  # the snapshots change below: trusted again once confirmed
            announce[peer] = [*update, *(self._prepare(key, ops, known) for key, ops in keys)]
            state.sent[peer] = update
        received = self._round(transport, 2, announce, {p: 2 + len(keys) for p, keys in recvs.items()})
        for peer, keys in recvs.items():
            values = received[peer]
            self.update[peer] = (values[0], values[1])
            self.sizes.update(zip((key for key, _ in keys), values[2:], strict=True))

    def _why_full(self, peer: int, confirmed: list[int]) -> str:
        if self.state.seq == 1:
            return self.state.origin
        if confirmed[0] == 0:
            return NO_BASELINE.get(confirmed[1], NO_BASELINE[NO_UPDATE_YET])
        return "the receiver did not confirm the last update"

    def _messages(self, direction: str) -> dict[int, list[tuple[MessageKey, list[TransferOp]]]]:
        """Every message of this rank in one direction with its ops, by peer, in schedule order."""
        out: dict[int, list[tuple[MessageKey, list[TransferOp]]]] = {}
        by_batch = self.schedule.sends if direction == "send" else self.schedule.receives
        for batch in self.schedule.batches:
            for peer, seq, ops in by_batch[batch.index]:
                out.setdefault(peer, []).append(((batch.index, peer, seq), ops))
        return out

    def _round(
        self, transport: CopyService, step: int, out: Mapping[int, list[int]], expect: Mapping[int, int]
    ) -> dict[int, list[int]]:
        """Send each peer in ``out`` its int64 values and receive ``expect[peer]`` values from each
        peer in ``expect``, tagged as batch ``num_batches + step``."""
        plan = self.ctx.plan
        device = exchange_device(transport)
        sends = {peer: torch.tensor(values, dtype=torch.int64, device=device) for peer, values in out.items()}
        recvs = {peer: torch.empty(n, dtype=torch.int64, device=device) for peer, n in expect.items()}
        what = "delta confirm round" if step == 1 else "delta announce round"
        side_round(transport, plan.rank, plan.num_batches + step, sends, recvs, what)
        return {peer: buffer.tolist() for peer, buffer in recvs.items()}

    def _prepare(self, key: MessageKey, ops: list[TransferOp], known: bool) -> int:
        """Build message ``key`` now: a delta when ``known`` and small enough, else dense; advance
        its snapshot. Returns the size to announce (-1: dense)."""
        if key not in self.state.eligible:
            self.state.eligible[key] = eligible(self.ctx, ops)
        if not self.state.eligible[key]:
            return -1
        ctx, state = self.ctx, self.state
        recipe = recipe_of(ctx, ops, "send")
        if recipe.nbytes == 0:
            return -1
        self.full += recipe.nbytes
        scratch = None
        if recipe.direct is not None:
            current = _as_bytes(recipe.direct)
        else:
            current = scratch = ctx.pool.take(recipe.nbytes, recipe.pieces[0][0].device)
            end = 0
            for view, slot in recipe.pieces:
                current[end : slot.offset].zero_()  # padding: the same bytes every time
                copy_into(slot_view(current, slot), view)
                end = slot.offset + slot.nbytes
        snapshot = state.snapshots.get(key)
        size = -1
        try:
            if snapshot is None:
                snapshot = state.snapshots[key] = current.clone()
            else:
                size = self._diff(key, current, snapshot, recipe.nbytes, known)
        finally:
            if scratch is not None:
                ctx.pool.give(scratch)
        if size < 0:
            message = recipe.direct if recipe.direct is not None else snapshot
            self.prepared[key] = Outgoing(key[1], message, 0)
            self.dense += 1
        if ctx.verify is not None:
            ctx.verify.sent(key[1], snapshot, [[slot] for _, slot in recipe.pieces])
        return size

    def _diff(
        self, key: MessageKey, current: torch.Tensor, snapshot: torch.Tensor, nbytes: int, known: bool
    ) -> int:
        """Diff ``current`` against its ``snapshot``, prepare the delta when ``known`` and small enough
        (returns its size, else -1), and bring the snapshot up to date either way."""
        cur16, old16 = current.view(torch.int16), snapshot.view(torch.int16)
        scan = delta_codec.Scan(cur16, old16)
        self.compared += cur16.numel()
        limit = DENSE_RATIO * nbytes
        too_dense = lambda words: delta_codec.HEADER_BYTES + TYPICAL_BYTES * words > limit  # noqa: E731
        if scan.blocks == 0:
            changes = None
        elif not known or too_dense(scan.estimate()):
            self.changed += int(torch.count_nonzero(torch.ne(cur16, old16)))
            snapshot.copy_(current)
            self.too_dense += known
            return -1
        else:
            changes = scan.changes()
            old16[changes.positions] = changes.new  # the snapshot takes the changed words
            self.changed += changes.positions.numel()
            if too_dense(changes.positions.numel()):
                self.too_dense += 1
                return -1
        payload = delta_codec.encode(cur16, old16, changes) if changes is not None else _empty(cur16)
        if payload.numel() > limit:
            self.too_dense += 1
            return -1
        self.prepared[key] = Outgoing(key[1], payload, self.ctx.meter.hold(payload.numel()))
        self.messages += 1
        return payload.numel()

    # -- during the pipeline --------------------------------------------------------------------------

    def outgoing(self, key: MessageKey) -> Outgoing | None:
        """The message ``begin`` prepared for ``key`` (None: the executor builds it as usual)."""
        return self.prepared.pop(key, None)

    def incoming(self, key: MessageKey, ops: list[TransferOp]) -> Incoming | None:
        """The receive for an encoded message ``key`` (None: a dense one, built as usual)."""
        size = self.sizes.get(key, -1)
        if size < 0:
            return None
        if key not in self.state.refusals:
            self.state.refusals[key] = _refusal(self.ctx, key, ops)
        if self.state.refusals[key]:
            raise ReshardError(self.state.refusals[key])
        recipe = recipe_of(self.ctx, ops, "recv")
        message = self.ctx.pool.take(size, recipe.pieces[0][0].device)
        return Incoming(key[1], message, [], False, self.ctx.meter.hold(size), recipe, lander=land_delta)

    def finish(self) -> None:
        """After every message landed: record each sender's update as applied."""
        self.state.applied = dict(self.update)
        self.state.lost = NO_UPDATE_YET

    def stats(self) -> DeltaStats:
        notes = [f"full to ranks {format_ranks(ranks)}: {why}" for why, ranks in self.notes.items()]
        if self.too_dense:
            notes.append(f"{self.too_dense} message{'s' if self.too_dense > 1 else ''} whole: "
                         "changed too densely for a delta")  # fmt: skip
        return DeltaStats(
            self.messages,
            self.dense,
            self.changed,
            self.compared,
            self.full,
            self.state.held_bytes,
            "; ".join(notes),
        )


def _refusal(ctx: ExecContext, key: MessageKey, ops: list[TransferOp]) -> str:
    """Why this rank cannot take a delta for the message ``key`` of ``ops`` ("" when it can)."""
    if not eligible(ctx, ops):
        return (
            f"rank {ctx.plan.rank}: rank {key[1]} sent a delta for tensors this rank cannot take one "
            f"for ({', '.join(dict.fromkeys(op.name for op in ops))}): every rank must pass the same "
            "transform"
        )
    for target, slot in recipe_of(ctx, ops, "recv").pieces:
        if target.dtype != slot.dtype:
            return (
                f"rank {ctx.plan.rank}: a delta from rank {key[1]} carries {slot.dtype} words for a "
                f"{target.dtype} destination; delta refits need destinations of the plan's dtype"
            )
    return ""


def eligible(ctx: ExecContext, ops: list[TransferOp]) -> bool:
    """Whether a message of ``ops`` can travel as a delta: untransformed, at least ``MIN_BYTES``,
    and every slot starting and ending on a whole 16-bit word (so no word holds bytes of two slots,
    or of a slot and padding). Both sides decide alike from the plan."""
    if ctx.transforms and any(op.name in ctx.transforms for op in ops):
        return False
    if sum(ctx.plan.bytes_of(op) for op in ops) < MIN_BYTES:
        return False
    slots, total = layout_slots([(tuple(op.sizes), ctx.wire_dtype(op.name)) for op in ops])
    return total % 2 == 0 and all(s.offset % 2 == 0 and s.nbytes % 2 == 0 for s in slots)


def _empty(words: torch.Tensor) -> torch.Tensor:
    """The delta of a message that did not change."""
    empty = torch.empty(0, dtype=torch.int64, device=words.device)
    none = delta_codec.Changes(empty, words[:0], words[:0])
    return delta_codec.encode(words, words, none)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
