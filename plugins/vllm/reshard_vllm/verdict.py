"""The last round of an update: every rank of the transfer group says how its part went.

Trainer ranks and engine workers each contribute one line (``ok <bytes received> <bytes expected>`` or
``error <message>``) through the group's store, so the round works even when the refit's own process
group broke. Every rank then knows every outcome: workers commit only when all ranks are ok, and the
trainer raises the workers' errors as its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard_core import TransferGroup


@dataclass
class Verdict:
    """This rank's outcome, or (from ``agree``) every rank's."""

    failures: dict[int, str] = field(default_factory=dict)
    """Rank -> its error text."""
    received: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Engine rank -> (bytes it received, bytes of the parameters it holds)."""
    seconds: float = 0.0

    @classmethod
    def ok(cls, received: int = -1, expected: int = -1) -> Verdict:
        return cls(received={-1: (received, expected)} if received >= 0 else {})

    @classmethod
    def failed(cls, rank: int, exc: BaseException) -> Verdict:
        text = str(exc).strip().replace("\n", " ") or type(exc).__name__
        return cls(failures={rank: f"{type(exc).__name__}: {text}"})

    def encode(self) -> str:
        if self.failures:
            return "error " + next(iter(self.failures.values()))
        if self.received:
            got, expected = self.received[-1]
            return f"ok {got} {expected}"
        return "ok"

    def message(self) -> str:
        """One line naming every failed rank and its error."""
        parts = [f"rank {r}: {text}" for r, text in sorted(self.failures.items())]
        return "weight update failed, previous weights kept on every worker: " + "; ".join(parts)


def agree(group: TransferGroup, mine: Verdict, *, what: str) -> Verdict:
    """Every rank's outcome (collective over ``group``); a rank that did not report within the group's
    timeout counts as failed. Raises ``TransportError`` only when the group's store is gone."""
    out = Verdict()
    absent = f"error did not report within {group.timeout:g} s (failed, exited or stalled)"
    for rank, line in enumerate(group.gather_text(mine.encode(), what=what, missing=absent)):
        word, _, rest = line.partition(" ")
        if word == "error":
            out.failures[rank] = rest
        elif rest:
            got, expected = (int(x) for x in rest.split())
            out.received[rank] = (got, expected)
    return out
