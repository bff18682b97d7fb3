"""``RefitReport``: what one refit did on one rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from .execute.delta_state import DeltaStats
from .execute.stats import ExecStats


@dataclass
class RefitReport:
    """What one ``refit`` did on this rank.

    Bytes: ``bytes_sent`` / ``bytes_received`` crossed the transport, ``bytes_local`` was copied
    inside the rank. ``messages``: transport messages this rank sent. ``seconds``: per phase
    (``extract``, ``exchange``, ``plan`` are zero when the prepared session was reused; ``pack``,
    ``transfer``, ``local``, ``unpack``, ``total``). With ``verify=True``, what this rank checked:
    ``verified_bytes`` (``bytes_received`` + ``bytes_local``, less transformed local copies) and
    ``verified_messages`` (the received messages); both 0 without ``verify``. With ``delta=True``,
    ``delta`` says what moved as deltas and why anything went whole (``execute.delta_state.DeltaStats``);
    None without ``delta``.
    """

    rank: int
    transport: str
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages: int
    batches: int
    peak_staging_bytes: int
    metadata_bytes: int
    reused_plan: bool
    seconds: dict[str, float] = field(default_factory=dict)
    verified_bytes: int = 0
    verified_messages: int = 0
    delta: DeltaStats | None = None

    @property
    def bytes_remote(self) -> int:
        return self.bytes_sent

    def __str__(self) -> str:
        mb = 1 / 2**20
        return (
            f"rank {self.rank}: sent {self.bytes_sent * mb:.1f} MiB, "
            f"received {self.bytes_received * mb:.1f} MiB, local {self.bytes_local * mb:.1f} MiB, "
            f"{self.messages} messages, {self.batches} batches, "
            f"{self.seconds.get('total', 0.0):.3f} s ({'cached plan' if self.reused_plan else 'new plan'})"
        )

    @classmethod
    def of(
        cls,
        rank: int,
        transport: str,
        stats: ExecStats,
        setup: dict[str, float] | None,
        metadata_bytes: int,
        total: float,
    ) -> RefitReport:
        """The report of one execution: ``setup`` holds the ``extract``/``exchange``/``plan`` seconds
        of a session built for it, None when a prepared session was reused."""
        seconds = dict(setup) if setup is not None else {"extract": 0.0, "exchange": 0.0, "plan": 0.0}
        seconds.update(
            pack=stats.seconds_pack, transfer=stats.seconds_transfer, local=stats.seconds_local,
            unpack=stats.seconds_unpack, total=total,
        )  # fmt: skip
        return cls(
            rank=rank,
            transport=transport,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            bytes_local=stats.bytes_local,
            messages=stats.messages,
            batches=stats.batches,
            peak_staging_bytes=stats.peak_staging_bytes,
            metadata_bytes=0 if setup is None else metadata_bytes,
            reused_plan=setup is None,
            seconds=seconds,
            verified_bytes=stats.verified_bytes,
            verified_messages=stats.verified_messages,
            delta=stats.delta,
        )
