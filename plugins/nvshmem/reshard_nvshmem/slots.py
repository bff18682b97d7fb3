"""One rank's part of a schedule as stream steps, with the signal values each step waits for.

Signal words (symmetric ``uint64``, never reset, so counts carry over from run to run):

- ``arrivals[j]`` on a receiver: every piece put into its slot ``j`` adds 1 (put-with-signal).
  Round ``t`` is complete once ``arrivals[t % slots]`` reaches the cumulative piece count.
- ``credits[p]`` on a sender: receiver ``p`` adds 1 each time it frees one of its slots for one
  round in which this sender writes to it. A sender's k-th such (round, receiver) waits for the
  k-th credit, so no slot is written before its previous round was drained.

A receiver grants the senders of its rounds ``0 .. slots-1`` when the run starts (its slots were
all drained by the previous run) and the senders of its round ``t + slots`` right after it drained
round ``t``. A rank receives on one stream, in round order, and sends to each receiver on a stream
of its own, in that receiver's round order. A put into round ``t`` of receiver ``r`` waits only on
``r`` draining round ``t - slots``, and ``r`` drains round ``t`` once the puts of round ``t``
landed: by induction on ``r``'s rounds nothing can deadlock, whatever other receivers do. (One
send stream per rank would serialise its receivers: each would wait for the ones before it.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedule import Piece, RankSchedule


@dataclass(frozen=True)
class SendStep:
    """On the stream to ``peer``: wait until ``credits[peer] >= credit``, then put ``pieces``
    into ``peer``'s slot of its round ``round``."""

    round: int
    peer: int
    credit: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class RecvStep:
    """Wait until ``arrivals[slot] >= arrived``, unpack ``pieces``, then grant ``grants``."""

    round: int
    slot: int
    arrived: int
    pieces: tuple[Piece, ...]
    grants: tuple[int, ...]


@dataclass(frozen=True)
class RankProgram:
    """What one rank enqueues for one run: start-of-run grants, then its send and receive steps."""

    grants: tuple[int, ...]
    sends: tuple[SendStep, ...]
    recvs: tuple[RecvStep, ...]


@dataclass
class SignalLedger:
    """Cumulative signal counts one rank expects; ``program`` advances them by one run."""

    slots: int
    arrivals: list[int] = field(default_factory=list)
    credits: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.arrivals:
            self.arrivals = [0] * self.slots

    def program(self, schedule: RankSchedule) -> RankProgram:
        """This rank's steps for its part of a run; the ledger then expects the counts after it."""
        if schedule.config.slots != self.slots:
            raise ValueError(f"ledger has {self.slots} slots, schedule {schedule.config.slots}")
        slots = self.slots
        sends: list[SendStep] = []
        by_step: dict[tuple[int, int], list[Piece]] = {}
        for p in sorted(schedule.sends, key=lambda p: (p.dst, p.round)):
            by_step.setdefault((p.round, p.dst), []).append(p)
        for (t, peer), pieces in by_step.items():
            self.credits[peer] = self.credits.get(peer, 0) + 1
            sends.append(SendStep(t, peer, self.credits[peer], tuple(pieces)))

        incoming: dict[int, list[Piece]] = {}
        for p in schedule.recvs:
            incoming.setdefault(p.round, []).append(p)

        def senders(t: int) -> tuple[int, ...]:
            return tuple(sorted({p.src for p in incoming.get(t, ())}))

        recvs: list[RecvStep] = []
        for t in range(schedule.rounds):
            pieces = tuple(incoming.get(t, ()))
            grants = senders(t + slots)
            if not pieces and not grants:
                continue
            slot = t % slots
            self.arrivals[slot] += len(pieces)
            recvs.append(RecvStep(t, slot, self.arrivals[slot], pieces, grants))
        start = tuple(peer for t in range(min(slots, schedule.rounds)) for peer in senders(t))
        return RankProgram(start, tuple(sends), tuple(recvs))
