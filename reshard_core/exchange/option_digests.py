"""Plan-shaping options agreed across ranks: a rank passing different ones must fail everyone.

Ranks that plan with different ``ignore``, ``tied``, ``max_batch_bytes``, ``cast``, ``verify``,
``delta`` or transports build plans or executions that do not pair up: tensors cross-wire silently
or a receiver aborts on a size mismatch. Each rank adds one CRC-32 per option to the agreement
all-gather (``coordination.agree``); every rank compares them and raises the same ``ReshardError`` naming the
option and the groups of ranks that differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import ReshardError
from ..plan.describe import format_ranks

if TYPE_CHECKING:
    from ..options import RefitOptions

OPTION_NAMES = ("ignore", "tied", "max_batch_bytes", "transport", "cast", "verify", "delta")


def option_digests(options: RefitOptions) -> tuple[int, ...]:
    """One non-negative int32 per option of ``OPTION_NAMES``, equal on two ranks iff the values are."""
    o = options
    transport = (
        o.transport
        if isinstance(o.transport, str)
        else getattr(o.transport, "name", type(o.transport).__name__)
    )
    values = (
        "\n".join(sorted(set(o.ignore))),
        "\n".join(f"{k}\t{v}" for k, v in sorted((o.tied or {}).items())),
        repr(o.max_batch_bytes),
        str(transport),
        repr(bool(o.cast)),
        repr(bool(o.verify)),
        repr(bool(o.delta)),
    )
    return tuple(zlib.crc32(v.encode()) & 0x7FFFFFFF for v in values)


def check_options(digests: Mapping[int, Sequence[int]]) -> None:
    """Raise ``ReshardError`` (the same text on every rank) when ranks passed different options.

    ``digests``: every rank's ``option_digests``, by global rank.
    """
    differing = []
    for i, option in enumerate(OPTION_NAMES):
        groups: dict[int, list[int]] = {}
        for rank, row in digests.items():
            groups.setdefault(row[i], []).append(rank)
        if len(groups) > 1:
            listed = " vs ".join(f"ranks {format_ranks(r)}" for r in sorted(groups.values()))
            differing.append(f"{option} ({listed})")
    if differing:
        raise ReshardError(
            "refit options differ across ranks: " + "; ".join(differing) + "; every rank must pass the "
            "same ignore=, tied=, max_batch_bytes=, transport=, cast=, verify= and delta= (they shape the "
            "plan and its execution)"
        )
