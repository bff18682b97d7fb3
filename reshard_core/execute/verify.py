"""Verified arrivals (``execute_plan(..., verify=True)``): every destination is checked against what
its sender sent.

Per op, the sender digests the bytes the op occupies in the message it sends, after packing (so in
the wire dtype, after any cast). The receiver, once the message landed, digests the destination
region it wrote, read in the message's byte order and dtype; for an op a transform owns it digests
the received wire buffers instead (before ``finalize_recv``: the wire bytes are not the destination
bytes), and where the receiver itself casts, the received slot. After the last batch each rank
sends each peer it sent to one int64 tensor of shape ``(ops, 2)``: the digests of every op it sent
that peer, in posting order (batch, message, op), tagged as batch ``plan.num_batches``
(``message_task_id``); the receiver, which knows the same ops, receives it and compares. A LOCAL
op's destination region is compared with its source region byte for byte (both are at hand: exact,
and cheaper than two digests); a transformed LOCAL op hands its wire tensors over in memory and is
not checked. Nothing of this runs without ``verify``.

Digest of an op: its bytes, slot after slot, each slot zero-padded to whole 8-byte words, read as
little-endian int64 words ``w_0 .. w_{n-1}``: the pair ``(Σ w_i, Σ (i+1)·w_i) mod 2**64``, computed
with torch reductions on the data's device (``Verifier.digest``). The plain sum changes with any
change confined to one word: every single-byte change and every bit flip is caught. The weighted
sum catches words that moved: two different words trading places ``d`` words apart are missed only
when they agree in their lowest ``64 - tz(d)`` bits (``tz``: trailing zero bits; for ``d < 2**32``,
in more than their first four bytes). Not caught: changes spread over several words that cancel in
both sums (it is no cryptographic hash: a crafted collision passes), the padding between slots (it
carries nothing), and a transform's landing (only its wire bytes are checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..coordination.gather import all_gather_bytes
from ..errors import ReshardError
from ..plan.ops import RankPlan, TransferOp
from ..transport.copy_service import CopyService
from ..views import materialize
from .messages import ExecContext, Incoming, land
from .side_round import side_round
from .slots import Slot
from .stats import ExecStats

_CHUNK = 1 << 18
"""Words digested per step: bounds the scratch memory (2 MiB per buffer)."""

_MAX_NAMES = 10
_MAX_PAIRS = 8
_positions: dict[torch.device, torch.Tensor] = {}  # 1.._CHUNK per device, read only


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensor`` as a flat uint8 view of its memory."""
    return tensor.reshape(-1).view(torch.uint8)


def _slot_bytes(message: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The bytes of ``slot`` in the flat uint8 ``message`` (its padding excluded)."""
    return message[slot.offset : slot.offset + slot.nbytes]


def _region_bytes(region) -> torch.Tensor:
    """A destination or source region's bytes in row-major order (a copy when not contiguous)."""
    return as_bytes(materialize(region).contiguous())


@dataclass
class _Expected:
    """The receiver's digest of one op it receives from a peer (set once its message landed)."""

    name: str
    digest: torch.Tensor | None = None


class Verifier:
    """One execution's digests: what this rank sent each peer, what it received and copied locally.

    The executor calls ``sent`` (from ``build_outgoing``), ``expect`` (when it posts a receive),
    ``land`` (instead of ``messages.land``), ``local`` (after each LOCAL op) and, after the last
    batch, ``finish``.
    """

    def __init__(self, plan: RankPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        """Where the digest tensors travel (the transport's kind of memory)."""
        self.sent_digests: dict[int, list[torch.Tensor]] = {}
        self.expected: dict[int, list[_Expected]] = {}
        self.pending: dict[int, list[_Expected]] = {}  # by id(incoming)
        self.locals: list[tuple[str, torch.Tensor]] = []  # (name, whether the bytes are equal)
        self.bytes = 0
        self.messages = 0
        self._work: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- the executor's hooks ---------------------------------------------------------------------

    def sent(self, peer: int, message: torch.Tensor, groups: Sequence[Sequence[Slot]]) -> None:
        """Digest each op of a message about to go to ``peer``; ``groups``: each op's slots."""
        data = as_bytes(message)
        self.sent_digests.setdefault(peer, []).extend(
            self.digest([_slot_bytes(data, s) for s in slots]) for slots in groups
        )

    def expect(self, peer: int, ops: Sequence[TransferOp], incoming: Incoming) -> None:
        """Register the ops of a message posted to be received from ``peer`` (posting order)."""
        entries = [_Expected(op.name) for op in ops]
        self.expected.setdefault(peer, []).extend(entries)
        self.pending[id(incoming)] = entries

    def land(self, ctx: ExecContext, incoming: Incoming) -> None:
        """Land a completed message (``messages.land``) and digest what it wrote, per op."""
        entries = self.pending.pop(id(incoming))
        data = as_bytes(incoming.message)
        if incoming.recipe is not None:
            land(ctx, incoming)
            for entry, (target, slot) in zip(entries, incoming.recipe.pieces, strict=True):
                entry.digest = self._landed(target, slot, data)
        else:
            for entry, landing in zip(entries, incoming.landings, strict=True):
                if landing.target is None:  # before finalize_recv: its views die with the call
                    parts = [data] if incoming.direct else [_slot_bytes(data, s) for s in landing.slots]
                    entry.digest = self.digest(parts)
            land(ctx, incoming)
            for entry, landing in zip(entries, incoming.landings, strict=True):
                if landing.target is not None:
                    entry.digest = self._landed(landing.target, landing.slots[0], data)
        self.bytes += incoming.message.nbytes
        self.messages += 1

    def local(self, ctx: ExecContext, op: TransferOp) -> None:
        """Compare a LOCAL op's destination region with its source region (in the destination's
        dtype), byte for byte: both are at hand, so no digest is needed."""
        if op.name in ctx.transforms:
            return
        src, dst = materialize(ctx.src_view(op)), materialize(ctx.dst_view(op))
        if src.dtype != dst.dtype:
            src = src.to(dst.dtype)
        self.locals.append((op.name, _same(src, dst)))
        self.bytes += self.plan.bytes_of(op)

    def finish(self, transport: CopyService, stats: ExecStats) -> None:
        """Exchange the digests with every peer (one small message per pair and direction), compare,
        and record the counts and any mismatch (``ExecStats.mismatches``) in ``stats``."""
        rank = self.plan.rank
        inbound = [
            (peer, entries, torch.empty((len(entries), 2), dtype=torch.int64, device=self.device))
            for peer, entries in self.expected.items()
        ]
        sends = {peer: self._stacked(digests) for peer, digests in self.sent_digests.items()}
        recvs = {peer: buffer for peer, _, buffer in inbound}
        side_round(transport, rank, self.plan.num_batches, sends, recvs, "verify digests")
        found = []
        for peer, entries, buffer in inbound:
            mine = self._stacked([e.digest for e in entries])
            found += _report(peer, rank, entries, (mine != buffer).any(1))
        if self.locals:
            names = [_Expected(name) for name, _ in self.locals]
            found += _report(None, rank, names, ~self._stacked([same for _, same in self.locals]))
        stats.verified_bytes, stats.verified_messages = self.bytes, self.messages
        stats.mismatches = tuple(found)

    # -- digests ----------------------------------------------------------------------------------

    def digest(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """``(Σ w_i, Σ (i+1)·w_i)`` as an int64 pair on the parts' device, over the int64 words of
        ``parts`` (flat uint8 tensors, each zero-padded to whole words), one stream in order."""
        plain = weighted = None
        base = 0
        for part in parts:
            n = part.numel()
            for start in range(0, n, 8 * _CHUNK):
                words = self._words(part if n <= 8 * _CHUNK else part[start : start + 8 * _CHUNK])
                k = words.numel()
                positions, product, _ = self._buffers(words.device)
                s1 = words.sum()
                if words.is_cuda:  # no int64 dot there
                    s2 = torch.mul(words, positions[:k], out=product[:k]).sum()
                else:
                    s2 = torch.dot(words, positions[:k])
                if base:  # positions continue the stream: shift the chunk's weights by ``base``
                    s2 += base * s1
                plain = s1 if plain is None else plain + s1
                weighted = s2 if weighted is None else weighted + s2
                base += k
        if plain is None:
            device = parts[0].device if parts else self.device
            return torch.zeros(2, dtype=torch.int64, device=device)
        return torch.stack([plain, weighted])

    def _words(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` (at most ``8 * _CHUNK`` bytes) as int64 words: a view when aligned and whole,
        else an aligned, zero-padded copy in scratch memory."""
        n = chunk.numel()
        if n % 8 == 0 and chunk.storage_offset() % 8 == 0 and chunk.data_ptr() % 8 == 0:
            return chunk.view(torch.int64)
        scratch = self._buffers(chunk.device)[2][: -(-n // 8) * 8]
        scratch[n:].zero_()
        scratch[:n].copy_(chunk)
        return scratch.view(torch.int64)

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Word positions ``1.._CHUNK``, a product buffer and a byte scratch buffer on ``device``."""
        positions = _positions.get(device)
        if positions is None:
            positions = _positions[device] = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device)
        work = self._work.get(device)
        if work is None:
            work = self._work[device] = (
                torch.empty(_CHUNK, dtype=torch.int64, device=device),
                torch.empty(8 * _CHUNK, dtype=torch.uint8, device=device),
            )
        return positions, *work

    def _landed(self, target, slot: Slot, data: torch.Tensor) -> torch.Tensor:
        """The digest of what landed in ``target`` from ``slot``: the destination region itself, or
        the received slot where the receiver cast it (a cast need not round-trip)."""
        if target.dtype == slot.dtype:
            return self.digest([_region_bytes(target)])
        return self.digest([_slot_bytes(data, slot)])

    def _stacked(self, digests: list[torch.Tensor]) -> torch.Tensor:
        if len({d.device for d in digests}) == 1:
            return torch.stack(digests).to(self.device)
        return torch.stack([d.to(self.device) for d in digests])


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether ``a`` and ``b`` (one shape and dtype) hold the same bytes, as a 0-d bool tensor on
    their device (no host sync on CUDA). Compared as the widest integers both layouts can be viewed
    as (NaN payloads and signed zeros count; wide elements compare fastest)."""
    for kind in (torch.int64, torch.int32, torch.int16, torch.uint8):
        try:
            x, y = a.view(kind), b.view(kind)
            break
        except RuntimeError:  # the rows' length or offset does not divide into this width
            continue
    else:
        x, y = _region_bytes(a), _region_bytes(b)
    if x.is_cuda:
        return (x != y).any().logical_not()
    return torch.tensor(torch.equal(x, y))


def _report(peer: int | None, rank: int, entries: Sequence[_Expected], bad: torch.Tensor) -> list[str]:
    """One line naming the tensors whose digests differ (``bad``: one flag per entry), or none."""
    names = list(dict.fromkeys(entries[i].name for i in bad.nonzero().flatten().tolist()))
    if not names:
        return []
    n = len(names)
    listed = ", ".join(names[:_MAX_NAMES]) + (f" and {n - _MAX_NAMES} more" if n > _MAX_NAMES else "")
    if peer is None:
        pair, origin = f"rank {rank} → rank {rank} (local copies)", "the source"
    else:
        pair, origin = f"rank {peer} → rank {rank}", "what was sent"
    return [f"{pair}: {n} tensor{'s' if n > 1 else ''} arrived different from {origin}: {listed}"]


def raise_mismatches(stats: ExecStats, group, timeout: float | None) -> None:
    """Collective over ``group`` after a verified execution on every rank: one small all-gather of
    each rank's ``stats.mismatches`` (bounded by ``timeout``); raise the same ``ReshardError`` on
    every rank when any rank found one, naming the tensors and each rank pair (sender → receiver)."""
    texts, _, _ = all_gather_bytes("\n".join(stats.mismatches).encode(), group, timeout, "verify")
    found = [line for text in texts if text for line in text.decode().split("\n")]
    if found:
        more = f"; and {len(found) - _MAX_PAIRS} more" if len(found) > _MAX_PAIRS else ""
        raise ReshardError("verify: " + "; ".join(found[:_MAX_PAIRS]) + more)
