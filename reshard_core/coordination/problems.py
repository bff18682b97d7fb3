"""One verdict for every rank before any data moves: did a rank fail to describe its models?

A rank that cannot extract or map its tensors (an unmapped parameter, a bad declaration, a hook
that raised) must not leave its peers waiting in the layout exchange. Each rank contributes its
problems as short text lines to one all-gather; then every rank knows all of them and raises
the same error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError
from ..plan.describe import format_ranks
from .gather import all_gather_bytes
from .refit_group import view_of

_MAX_LISTED = 12


@dataclass
class Problems:
    """This rank's problems: ``unmapped`` physical tensor names per ``(side, format name)`` and
    free-text ``errors``."""

    unmapped: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        lines = [
            f"u\t{side}\t{fmt}\t{name}" for (side, fmt), names in self.unmapped.items() for name in names
        ]
        lines += ["e\t" + text.replace("\n", " ") for text in self.errors]
        return "\n".join(lines).encode()


def raise_if_any(problems: Problems, group=None, timeout: float | None = None) -> None:
    """Collective over ``group``: raise ``PlanError`` on every rank when any rank has a problem
    (``TransportError`` when a rank does not join within ``timeout`` seconds)."""
    ranks = view_of(group).ranks
    blobs, _, _ = all_gather_bytes(problems.encode(), group, timeout, "refit could not start")
    unmapped: dict[tuple[str, str], dict[str, list[int]]] = {}
    errors: dict[str, list[int]] = {}
    for rank, blob in zip(ranks, blobs, strict=True):
        for line in blob.decode().splitlines():
            kind, *rest = line.split("\t")
            if kind == "u":
                side, fmt, name = rest
                unmapped.setdefault((side, fmt), {}).setdefault(name, []).append(rank)
            else:
                errors.setdefault(rest[0], []).append(rank)
    parts = [_unmapped_text(side, fmt, names) for (side, fmt), names in sorted(unmapped.items())]
    parts += [f"rank{'s' if len(r) > 1 else ''} {format_ranks(r)}: {text}" for text, r in errors.items()]
    if parts:
        raise PlanError("; ".join(parts))


def _unmapped_text(side: str, fmt: str, names: dict[str, list[int]]) -> str:
    word = "source" if side == "src" else "destination"
    listed = [f"{n} (ranks {format_ranks(r)})" for n, r in sorted(names.items())[:_MAX_LISTED]]
    more = f", … ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return (
        f"{len(names)} {word} tensor{'s' if len(names) > 1 else ''} of format '{fmt}' map to no logical "
        f"tensor: {', '.join(listed)}{more}; pass ignore= with their names to leave them out"
    )
