"""What one execution of a rank's plan did: bytes, messages, batches, staging, seconds per phase."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .delta_state import DeltaStats


@dataclass
class ExecStats:
    """Counters of one ``execute_plan`` call on one rank.

    Bytes are wire bytes (packed messages, slot alignment included); ``bytes_local`` counts the
    logical bytes of LOCAL ops. ``messages_sent`` / ``messages_received`` count transport messages
    (one per peer per batch and direction). ``batches`` counts the batches this rank took part in.
    ``peak_staging_bytes`` is the most transient memory held at once: pack buffers, staged receives,
    transform wire tensors and buffers, and what transforms declare via ``transient_bytes``.
    Seconds: ``pack`` (packing sends, preparing receives), ``transfer`` (issuing and waiting on the
    transport), ``local`` (LOCAL ops), ``unpack`` (landing received data, finalize hooks); with
    ``verify`` the digests count in the phase they are computed in (``verify.py``).
    With ``verify``: ``verified_bytes`` are the bytes of the received messages (whole, slot padding
    included) and of the LOCAL ops whose arrival was checked (all but transformed LOCAL ops), and
    ``verified_messages`` the received messages checked; ``mismatches`` holds one line per rank
    pair whose tensors arrived different from what was sent (``"rank 0 → rank 2: 1 tensor arrived
    different from what was sent: w"``), and one for this rank's local copies that differ from
    their source. ``delta``: what a delta execution did (``delta_state.DeltaStats``), None without one.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    batches: int = 0
    peak_staging_bytes: int = 0
    seconds_pack: float = 0.0
    seconds_transfer: float = 0.0
    seconds_local: float = 0.0
    seconds_unpack: float = 0.0
    seconds_total: float = 0.0
    verified_bytes: int = 0
    verified_messages: int = 0
    mismatches: tuple[str, ...] = ()
    delta: DeltaStats | None = None

    @property
    def messages(self) -> int:
        """Messages this rank sent (every message is counted once, by its sender)."""
        return self.messages_sent

    def timed(self, phase: str) -> _Phase:
        """A context manager adding the time spent in its ``with`` body to ``seconds_<phase>``."""
        return _Phase(self, f"seconds_{phase}")


class _Phase:
    """``ExecStats.timed``'s context manager (a plain class: it runs a few times per message)."""

    __slots__ = ("stats", "field", "start")

    def __init__(self, stats: ExecStats, field: str) -> None:
        self.stats, self.field, self.start = stats, field, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self.stats, self.field, getattr(self.stats, self.field) + time.perf_counter() - self.start)


class StagingMeter:
    """Tracks transient bytes held now and the peak, for ``ExecStats.peak_staging_bytes``."""

    def __init__(self) -> None:
        self.held = 0
        self.peak = 0

    def hold(self, nbytes: int) -> int:
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes
