"""What the executor's optional features promise it: the base layer (``messages``, ``executor``)
calls them only through these interfaces and imports neither ``verify`` nor ``delta``.

A feature is set on the ``ExecContext`` for one execution (``ctx.verify``, ``ctx.delta``); None keeps
the data path bare. Message arguments are ``messages.Incoming`` / ``Outgoing`` (typed ``Any`` here,
so this module stays below ``messages``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

from ..plan.ops import TransferOp
from ..transport.copy_service import CopyService
from .slots import Slot
from .stats import ExecStats


class VerifyFeature(Protocol):
    """Checks every arrival (``verify.Verifier``)."""

    def sent(self, peer: int, message: torch.Tensor, groups: Sequence[Sequence[Slot]]) -> None:
        """Digest each op's bytes of a packed message to ``peer``."""

    def expect(self, peer: int, ops: Sequence[TransferOp], incoming: Any) -> None:
        """Note what a message from ``peer`` should hold."""

    def land(self, ctx: Any, incoming: Any) -> None:
        """Land a received message, then digest what it wrote."""

    def local(self, ctx: Any, op: TransferOp) -> None:
        """Digest what a local copy wrote."""

    def finish(self, transport: CopyService, stats: ExecStats) -> None:
        """After the last batch: cross the digests with every peer, counting in ``stats``."""


class DeltaFeature(Protocol):
    """Moves only changed words (``delta.DeltaRun``)."""

    def begin(self, transport: CopyService) -> None:
        """Before the first batch: the confirm and announce rounds."""

    def outgoing(self, key: Hashable) -> Any:
        """The encoded message to send for ``key``, or None to send it dense."""

    def incoming(self, key: Hashable, ops: list[TransferOp]) -> Any:
        """The receive for an encoded message ``key``, or None for a dense one."""

    def finish(self) -> None:
        """After every message landed."""

    def stats(self) -> Any:
        """What moved as deltas (``delta_state.DeltaStats``)."""
