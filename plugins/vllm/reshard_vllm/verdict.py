"""The last round of an update: every rank of the transfer group says how its part went.

Trainer ranks and engine workers each contribute one line (``ok <bytes received> <bytes expected>`` or
``error <message>``) through the group's store, so the round works even when the refit's own process
group broke. Every rank then knows every outcome: workers commit only when all ranks are ok, and the
trainer raises the workers' errors as its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard_core import TransferGroup

SUPERSEDED_KEY = "reshard/vllm/superseded"
"""Set in a trainer's store by the engine when a newer trainer's init takes the engine over."""


@dataclass
class Verdict:
    """Every rank's outcome of one update (what ``agree`` returns)."""

    failures: dict[int, str] = field(default_factory=dict)
    """Rank -> its error text."""
    received: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Engine rank -> (bytes it received, bytes of the parameters it holds)."""
    seconds: float = 0.0

    def message(self) -> str:
        """One line naming every failed rank and its error (ranks that failed alike share one entry)."""
        by_text: dict[str, list[int]] = {}
        for rank, text in sorted(self.failures.items()):
            by_text.setdefault(text, []).append(rank)
        parts = [
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
            for text, ranks in by_text.items()
        ]
        return "weight update failed, previous weights kept on every worker: " + "; ".join(parts)


def ok(received: int | None = None, expected: int | None = None) -> str:
    """This rank's line for a part that went well (an engine worker says what it received)."""
    return "ok" if received is None else f"ok {received} {expected}"


def failed(exc: BaseException) -> str:
    """This rank's line for a part that failed with ``exc``."""
    text = str(exc).strip().replace("\n", " ") or type(exc).__name__
    return f"error {type(exc).__name__}: {text}"


def agree(group: TransferGroup, mine: str, *, what: str) -> Verdict:
    """Every rank's outcome (collective over ``group``); a rank that did not report within the group's
    timeout counts as failed. Raises ``TransportError`` only when the group's store is gone."""
    out = Verdict()
    absent = f"error did not report within {group.timeout:g} s (failed, exited or stalled)"
    for rank, line in enumerate(group.gather_text(mine, what=what, missing=absent)):
        word, _, rest = line.partition(" ")
        if word == "error":
            out.failures[rank] = rest
        elif rest:
            got, expected = (int(x) for x in rest.split())
            out.received[rank] = (got, expected)
    return out
