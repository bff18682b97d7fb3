"""Which bytes go to which receiver slot in which round: a pure function of one run's messages.

Model. Every rank owns ``slots`` symmetric receive slots of ``slot_bytes`` each. Round ``t`` lands
in slot ``t % slots`` of every receiver, so while a receiver unpacks round ``t`` its peers already
fill rounds ``t+1 .. t+slots-1`` (double buffering with the default 2 slots); slot ``t % slots`` is
written again in round ``t + slots`` only after its receiver drained round ``t`` (the engine waits
for that credit). Per round a receiver accepts at most ``slot_bytes`` (pieces from several senders
side by side, each at an ``align``-ed offset) and a sender puts at most ``slot_bytes``.

Lower bound: ``ceil(max over ranks of max(bytes sent, bytes received) / slot_bytes)`` rounds.
(Counting in rounds of all ``slots`` slots, as ``bytes / (slot_bytes * slots)``, divides both the
bound and the round count by ``slots``; the ratio is the same.)

Algorithm: greedy per round, most loaded pairs first (by the remaining load of the busier end),
each pair taking what both ends can still take. The greedy is maximal, so the pair finishing last
had one saturated end in every earlier round: rounds <= 2 * bound + 1 always; in practice (see
tests) it stays within a few percent of the bound.

A pair's messages form one byte stream in ``order``; pieces never cross a message (one put reads
one source tensor) and pieces of a message are never smaller than ``min_piece`` unless they are
its last bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

MiB = 1 << 20
DEFAULT_SLOT_BYTES = 64 * MiB
DEFAULT_SLOTS = 2
SLOT_BYTES_ENV = "RESHARD_NVSHMEM_SLOT_BYTES"
SLOTS_ENV = "RESHARD_NVSHMEM_SLOTS"


@dataclass(frozen=True)
class StagingConfig:
    """Receive staging per rank: ``slots`` buffers of ``slot_bytes``; piece offsets align to ``align``.

    ``min_piece`` (capped at ``slot_bytes``): no message is cut into a piece smaller than this
    except its tail, so a nearly full slot is not filled with slivers.
    """

    slot_bytes: int = DEFAULT_SLOT_BYTES
    slots: int = DEFAULT_SLOTS
    align: int = 256
    min_piece: int = 4096

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
class Schedule:
    """The pieces of one run, sorted by (round, src, dst, order, msg_offset)."""

    config: StagingConfig
    world: int
    pieces: tuple[Piece, ...]
    rounds: int
    lower_bound: int
    _by_rank: dict[int, tuple[tuple[Piece, ...], tuple[Piece, ...]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def ratio(self) -> float:
        """Rounds over the lower bound (1.0 when nothing moves)."""
        return self.rounds / self.lower_bound if self.lower_bound else 1.0

    def sends_of(self, rank: int) -> tuple[Piece, ...]:
        """The pieces ``rank`` puts, in schedule order."""
        return self._split(rank)[0]

    def recvs_of(self, rank: int) -> tuple[Piece, ...]:
        """The pieces landing in ``rank``'s slots, in schedule order."""
        return self._split(rank)[1]

    def _split(self, rank: int) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        if rank not in self._by_rank:
            self._by_rank[rank] = (
                tuple(p for p in self.pieces if p.src == rank),
                tuple(p for p in self.pieces if p.dst == rank),
            )
        return self._by_rank[rank]


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
    """Schedule ``messages`` over ``world`` ranks (see the module docstring for the model)."""
    cfg = config or StagingConfig()
    msgs = validate_messages(messages, world)
    streams: dict[tuple[int, int], list[Message]] = {}
    for m in msgs:
        if m.nbytes:
            streams.setdefault((m.src, m.dst), []).append(m)
    cursor = {pair: [0, 0] for pair in streams}  # message index, offset inside it
    left = {pair: sum(m.nbytes for m in ms) for pair, ms in streams.items()}
    out_left: dict[int, int] = {}
    in_left: dict[int, int] = {}
    for (s, r), n in left.items():
        out_left[s] = out_left.get(s, 0) + n
        in_left[r] = in_left.get(r, 0) + n

    min_piece = min(cfg.min_piece, cfg.slot_bytes)
    pieces: list[Piece] = []
    t = 0
    while left:
        slot = t % cfg.slots
        send_room = dict.fromkeys(out_left, cfg.slot_bytes)
        recv_used = dict.fromkeys(in_left, 0)
        order = sorted(left, key=lambda p: (-max(out_left[p[0]], in_left[p[1]]), -left[p], p))
        for pair in order:
            s, r = pair
            stream, cur = streams[pair], cursor[pair]
            while cur[0] < len(stream):
                msg = stream[cur[0]]
                offset = -(-recv_used[r] // cfg.align) * cfg.align
                rest = msg.nbytes - cur[1]
                n = min(rest, send_room[s], cfg.slot_bytes - offset)
                if n <= 0 or (n < rest and n < min_piece):
                    break
                pieces.append(Piece(t, s, r, msg.order, cur[1], n, slot, offset))
                send_room[s] -= n
                recv_used[r] = offset + n
                out_left[s] -= n
                in_left[r] -= n
                left[pair] -= n
                cur[1] += n
                if cur[1] == msg.nbytes:
                    cur[0], cur[1] = cur[0] + 1, 0
            if not left[pair]:
                del left[pair]
        t += 1
    pieces.sort()
    return Schedule(cfg, world, tuple(pieces), t, lower_bound(msgs, cfg.slot_bytes))


@lru_cache(maxsize=64)
def cached_schedule(messages: tuple[Message, ...], world: int, config: StagingConfig) -> Schedule:
    """``build_schedule`` memoised on the exact message tuple (the plan's run signature)."""
    return build_schedule(messages, world, config)
