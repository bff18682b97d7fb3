"""Which bytes go to which receiver slot in which round: pure functions of a run's messages.

Model. Every rank owns ``slots`` symmetric receive slots of ``slot_bytes`` each. A receiver's round
``t`` lands in its slot ``t % slots``, so while it unpacks round ``t`` its senders already fill
rounds ``t+1 .. t+slots-1`` (double buffering with the default 2 slots); slot ``t % slots`` is
written again in round ``t + slots`` only after round ``t`` was drained (the engine waits for that
credit). A sender puts to each receiver on a stream of its own, so rounds are the receiver's: no
rank waits for a global step.

Layout. Each slot is cut into one region per sender (``Share.offset``, ``align``-ed); in every round
a sender fills its region with the next ``Share.per_round`` bytes of its messages to that receiver
(messages in order, cut at round and message boundaries, so a put never reads two tensors). The
receiver spreads each sender's bytes evenly over ``max(its own rounds, the sender's rounds)``,
where a rank's rounds are ``ceil(bytes / slot_bytes)`` of what it receives, resp. sends, in the
run. So every rank receives at most ``slot_bytes`` and sends about ``slot_bytes`` per round (up to
rounding, and shares grown to ``min_piece`` where a slot has room), all ranks send and receive in
every round, and
the rounds stay within rounding of the bound ``ceil(max over ranks of bytes sent or received /
slot_bytes)`` (the tests measure it on realistic reshards).

Agreement. The receiver needs, besides its own receives, each sender's total outgoing bytes; the
sender needs only its ``Share``. Both travel in the per-run pairwise handshake (``exchange.py``);
``sender_pieces`` then reproduces exactly the pieces of ``receiver_layout``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

MiB = 1 << 20
DEFAULT_SLOT_BYTES = 64 * MiB
DEFAULT_SLOTS = 2
SLOT_BYTES_ENV = "RESHARD_NVSHMEM_SLOT_BYTES"
SLOTS_ENV = "RESHARD_NVSHMEM_SLOTS"


@dataclass(frozen=True)
class StagingConfig:
    """Receive staging per rank: ``slots`` buffers of ``slot_bytes``; piece offsets align to ``align``.

    ``min_piece``: a sender's share of a slot grows to this size where the slot has room left,
    for fewer, larger puts (it never adds rounds).
    """

    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS
    align: int = 256
    min_piece: int = MiB

    def __post_init__(self) -> None:
        for name in ("slot_bytes", "slots", "align", "min_piece"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"staging {name} must be a positive integer, got {value!r}")
        if self.align & (self.align - 1) or self.slot_bytes % self.align:
            raise ValueError(
                f"staging align must be a power of two dividing slot_bytes, got align={self.align}, "
                f"slot_bytes={self.slot_bytes}"
            )

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.slots

    @classmethod
    def resolve(
        cls, slot_bytes: int | None = None, slots: int | None = None, env: Mapping[str, str] | None = None
    ) -> StagingConfig:
        """Constructor arguments win, then ``RESHARD_NVSHMEM_SLOT_BYTES`` / ``RESHARD_NVSHMEM_SLOTS``."""
        env = os.environ if env is None else env
        if slot_bytes is None:
            slot_bytes = _env_int(env, SLOT_BYTES_ENV, DEFAULT_SLOT_BYTES)
        if slots is None:
            slots = _env_int(env, SLOTS_ENV, DEFAULT_SLOTS)
        return cls(slot_bytes=slot_bytes, slots=slots)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of bytes/slots, got {text!r}") from None


@dataclass(frozen=True, order=True)
class Message:
    """One packed buffer from ``src`` to ``dst`` (group ranks); ``order`` is its index in that pair."""

    src: int
    dst: int
    order: int
    nbytes: int


@dataclass(frozen=True, order=True)
class Piece:
    """Bytes ``[msg_offset, msg_offset + nbytes)`` of message (src, dst, order), put in ``round``
    at ``slot_offset`` of the receiver's slot ``slot``."""

    round: int
    src: int
    dst: int
    order: int
    msg_offset: int
    nbytes: int
    slot: int
    slot_offset: int


@dataclass(frozen=True)
class RankSchedule:
    """One rank's part of a run: the pieces it puts (by receiver, then in that receiver's rounds)
    and the pieces landing in its own slots over its ``rounds`` rounds."""

    config: StagingConfig
    sends: tuple[Piece, ...]
    recvs: tuple[Piece, ...]
    rounds: int


@dataclass(frozen=True)
class Share:
    """What a receiver grants one sender: a region at ``offset`` of each of its slots, filled with
    ``per_round`` bytes of the sender's stream per round (0 when it sends only empty messages)."""

    offset: int
    per_round: int


@dataclass(frozen=True)
class ReceiverLayout:
    """Where every incoming byte of one receiver lands, and the share each sender is told."""

    pieces: tuple[Piece, ...]
    rounds: int
    shares: dict[int, Share]


def _align(n: int, cfg: StagingConfig) -> int:
    return -(-n // cfg.align) * cfg.align


def _shares(totals: dict[int, int], out: dict[int, int], rounds: int, cfg: StagingConfig) -> dict[int, int]:
    """Per-round bytes of each sender when the receiver itself takes ``rounds`` rounds: its bytes
    spread over those rounds, or over the sender's own rounds when it is the busier one."""
    return {src: -(-d // max(rounds, -(-out.get(src, d) // cfg.slot_bytes))) for src, d in totals.items()}


@lru_cache(maxsize=4096)
def receiver_layout(
    dst: int,
    incoming: tuple[tuple[int, int], ...],
    sender_out: tuple[tuple[int, int], ...],
    world: int,
    cfg: StagingConfig,
) -> ReceiverLayout:
    """Layout of receiver ``dst`` for its ``incoming`` ``(src, nbytes)`` messages (each sender's in
    order), given each sender's total outgoing bytes in the run (``sender_out``). Memoised, so a
    plan's later refits recompute nothing. ``ValueError`` when a slot cannot hold one aligned
    region per sender."""
    sizes: dict[int, list[int]] = {}
    for src, nbytes in incoming:
        sizes.setdefault(src, []).append(nbytes)
    order = sorted(sizes, key=lambda s: (s - dst) % world)  # receivers start at different senders
    totals = {src: sum(sizes[src]) for src in order}
    out = dict(sender_out)

    def fits(rounds: int) -> bool:
        per_round = _shares(totals, out, rounds, cfg)
        return sum(_align(q, cfg) for q in per_round.values()) <= cfg.slot_bytes

    low = max(1, -(-sum(totals.values()) // cfg.slot_bytes))
    high = max([low] + list(totals.values()))
    if not fits(high):
        raise ValueError(
            f"{cfg.slot_bytes}-byte slots cannot hold one {cfg.align}-byte region for each of "
            f"{len(totals)} senders of rank {dst}"
        )
    while low < high:  # the fewest own rounds whose shares fit in a slot
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    per_round = _shares(totals, out, low, cfg)
    # Spare room in the slot lets small shares grow to min_piece: fewer, larger puts, same rounds.
    room = cfg.slot_bytes - sum(_align(q, cfg) for q in per_round.values())
    for src in sorted(per_round, key=lambda s: (per_round[s], s)):
        want = min(totals[src], cfg.min_piece)
        extra = _align(want, cfg) - _align(per_round[src], cfg)
        if per_round[src] < want and extra <= room:
            per_round[src], room = want, room - extra
    shares: dict[int, Share] = {}
    offset = 0
    for src in order:
        shares[src] = Share(offset, per_round[src])
        offset += _align(per_round[src], cfg)
    pieces = tuple(p for src in order for p in sender_pieces(src, dst, sizes[src], shares[src], cfg))
    rounds = max((p.round + 1 for p in pieces), default=0)
    return ReceiverLayout(pieces, rounds, shares)


def sender_pieces(
    src: int, dst: int, sizes: Sequence[int], share: Share, cfg: StagingConfig
) -> tuple[Piece, ...]:
    """The pieces of ``src``'s messages (``sizes`` in order) to ``dst`` under ``share``."""
    pieces: list[Piece] = []
    pos = 0  # position in src's stream to dst
    for order, nbytes in enumerate(sizes):
        done = 0
        while done < nbytes:
            t, into = divmod(pos, share.per_round)
            n = min(nbytes - done, share.per_round - into)
            pieces.append(Piece(t, src, dst, order, done, n, t % cfg.slots, share.offset + into))
            done, pos = done + n, pos + n
    return tuple(pieces)


@dataclass(frozen=True)
class Schedule:
    """Every receiver's layout of one run at once (for analysis and tests; ranks never build it)."""

    config: StagingConfig
    world: int
    pieces: tuple[Piece, ...]
    rounds: int
    lower_bound: int
    layouts: dict[int, ReceiverLayout]

    @property
    def ratio(self) -> float:
        """Rounds over the lower bound (1.0 when nothing moves)."""
        return self.rounds / self.lower_bound if self.lower_bound else 1.0

    def for_rank(self, rank: int) -> RankSchedule:
        """What ``rank`` would derive for itself after its handshakes."""
        mine = [p for p in self.pieces if p.src == rank]
        sends = tuple(sorted(mine, key=lambda p: (p.dst, p.round, p.order, p.msg_offset)))
        layout = self.layouts.get(rank, ReceiverLayout((), 0, {}))
        return RankSchedule(self.config, sends, layout.pieces, layout.rounds)


def validate_messages(messages: Iterable[Message], world: int) -> tuple[Message, ...]:
    """Sorted messages, or ``ValueError`` naming the first bad one.

    Ranks must lie in ``[0, world)``, src != dst, nbytes >= 0, and each pair's orders must be
    exactly ``0..k-1``.
    """
    msgs = tuple(sorted(messages))
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be a positive integer, got {world!r}")
    expected: dict[tuple[int, int], int] = {}
    for m in msgs:
        if not (0 <= m.src < world and 0 <= m.dst < world):
            raise ValueError(f"message {m} names a rank outside [0, {world})")
        if m.src == m.dst:
            raise ValueError(f"message {m} goes from a rank to itself; local copies are not scheduled")
        if m.nbytes < 0:
            raise ValueError(f"message {m} has a negative size")
        want = expected.get((m.src, m.dst), 0)
        if m.order != want:
            raise ValueError(
                f"messages {m.src}->{m.dst}: expected order index {want}, got {m.order} "
                "(orders must be 0..k-1 without gaps or repeats)"
            )
        expected[(m.src, m.dst)] = want + 1
    return msgs


def lower_bound(messages: Iterable[Message], slot_bytes: int) -> int:
    """``ceil(max over ranks of max(bytes sent, bytes received) / slot_bytes)``."""
    load: dict[tuple[str, int], int] = {}
    for m in messages:
        load[("out", m.src)] = load.get(("out", m.src), 0) + m.nbytes
        load[("in", m.dst)] = load.get(("in", m.dst), 0) + m.nbytes
    return math.ceil(max(load.values(), default=0) / slot_bytes)


def build_schedule(messages: Iterable[Message], world: int, config: StagingConfig | None = None) -> Schedule:
    """Every receiver's layout for ``messages`` (validated; see ``validate_messages``), as the ranks
    derive them after their handshakes."""
    cfg = config or StagingConfig()
    msgs = validate_messages(messages, world)
    incoming: dict[int, list[tuple[int, int]]] = {}
    out: dict[int, int] = {}
    for m in msgs:
        incoming.setdefault(m.dst, []).append((m.src, m.nbytes))
        out[m.src] = out.get(m.src, 0) + m.nbytes
    layouts = {
        dst: receiver_layout(dst, tuple(inc), tuple(sorted((s, out[s]) for s, _ in set(inc))), world, cfg)
        for dst, inc in incoming.items()
    }
    pieces = tuple(sorted(p for layout in layouts.values() for p in layout.pieces))
    rounds = max((layout.rounds for layout in layouts.values()), default=0)
    return Schedule(cfg, world, pieces, rounds, lower_bound(msgs, cfg.slot_bytes), layouts)
