"""What delta refits keep between executions: a session's ``DeltaState`` (snapshots, update ids),
the ``DeltaStats`` one execution reports, and which execution last wrote each destination storage
(``stamp``), so that anything else writing a destination makes the next delta refit full for it.
``delta`` explains the protocol.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..views import storage_views

_serials = itertools.count(1)
_writers: dict[int, int] = {}
"""Destination storage address -> serial of the ``DeltaState`` whose execution wrote it last (0: an
execution without delta). Only kept once some delta state exists."""

MessageKey = tuple[int, int, int]
"""``(batch, peer, seq)``: one message of the schedule."""

NO_UPDATE_YET, REWRITTEN, LAST_REFIT_FAILED = 0, 1, 2
NO_BASELINE = {
    NO_UPDATE_YET: "the receiver holds no baseline: it applied no update of this session yet",
    REWRITTEN: (
        "the receiver holds no baseline: its destinations were written since by another refit (one "
        "without delta, or another session's)"
    ),
    LAST_REFIT_FAILED: "the receiver holds no baseline: its last refit failed",
}
"""Why a receiver has no baseline, by the code it confirms as ``(0, code)`` (an update id's nonce is
never 0)."""


@dataclass(frozen=True)
class DeltaStats:
    """What one delta execution did on this rank (``RefitReport.delta``).

    ``messages`` went as deltas, ``dense_messages`` whole; ``changed_words`` of ``compared_words``
    16-bit words differed from the snapshots; ``full_bytes`` is what a full refit would have sent
    (``RefitReport.bytes_sent`` is what was); ``held_bytes`` the snapshots kept for the next delta
    refit; ``note`` says why messages went dense (empty when none had to)."""

    messages: int = 0
    dense_messages: int = 0
    changed_words: int = 0
    compared_words: int = 0
    full_bytes: int = 0
    held_bytes: int = 0
    note: str = ""


@dataclass
class DeltaState:
    """What a prepared session keeps between delta refits (see the module docstring)."""

    serial: int = field(default_factory=lambda: next(_serials))
    nonce: int = field(default_factory=lambda: secrets.randbits(62) + 1)
    seq: int = 0
    snapshots: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per receiver: the update id this rank's snapshots for it stand at."""
    applied: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per sender: the id of the last update from it this rank applied in full."""
    eligible: dict[MessageKey, bool] = field(default_factory=dict)
    """Per message sent: whether it can go as a delta (fixed by the plan, decided once)."""
    refusals: dict[MessageKey, str] = field(default_factory=dict)
    """Per message received: why this rank cannot take it as a delta ("": it can), decided once."""
    origin: str = "first delta refit of this plan"
    """Why its first execution is full (the session's plan is new, or was rebuilt)."""
    lost: int = NO_UPDATE_YET
    """Why this rank, as a receiver, holds no baseline from a sender it has none from (a
    ``NO_BASELINE`` code, sent in the confirm round in place of an update id)."""

    def invalidate(self) -> None:
        """After a failed execution: the next one is dense for every pair this rank is in."""
        self.sent.clear()
        self.applied.clear()
        self.lost = LAST_REFIT_FAILED

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())


def stamp(dst: Mapping[str, torch.Tensor | None], serial: int) -> None:
    """Record that an execution of the ``DeltaState`` ``serial`` (0: one without delta) writes these
    destinations. A no-op until the first delta refit, so plain refits pay nothing."""
    if serial or _writers:
        for key in _storage_keys(dst):
            _writers[key] = serial


def written_only_by(dst: Mapping[str, torch.Tensor | None], serial: int) -> bool:
    """Whether the last execution writing each of these destinations was one of ``serial``'s."""
    return all(_writers.get(key) == serial for key in _storage_keys(dst))


def _storage_keys(dst: Mapping[str, torch.Tensor | None]) -> Iterable[int]:
    """The storage address under each destination (a split or piecewise view's: its parts')."""
    for tensor in dst.values():
        for view in storage_views(tensor):
            yield getattr(view, "_local_tensor", view).untyped_storage().data_ptr()
