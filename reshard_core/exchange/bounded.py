"""Collectives bounded by the caller's ``timeout``: a peer that never joins fails its peers in time.

Without a bound, a rank that failed on its own, exited or stalled before a pre-execution collective
leaves every peer waiting until the process-group timeout (30 minutes by default). ``wait`` waits
for an ``async_op`` collective at most ``timeout`` seconds and then raises ``TransportError``. To
name the ranks that never joined, each rank that timed out marks itself in the default store
under a per-group sequence number and, after a short grace, lists the ranks that did not
(a stalled rank never marks itself; only the failure path touches the store).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist

from ..errors import TransportError
from ..plan.describe import format_ranks

_sequence: dict[tuple[int, ...], int] = {}
_GRACE = 2.0


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the world) in group-rank order."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def wait(work: Any, timeout: float | None, group: Any, what: str) -> None:
    """Wait for ``work`` (a collective over ``group``, started with ``async_op=True``); raise
    ``TransportError`` naming ``what`` and, when it can be told, the ranks that did not join."""
    ranks = group_ranks(group)
    seq = _sequence[ranks] = _sequence.get(ranks, 0) + 1
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        within = f" within {timeout:g} s" if timeout is not None else ""
        missing = _missing(ranks, seq, timeout) if timeout is not None else None
        who = (
            f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} of {format_ranks(ranks)} "
            f"did not join{within}"
            if missing
            else f"ranks {format_ranks(ranks)} did not all join{within}"
        )
        raise TransportError(
            f"rank {dist.get_rank()}: {what}: {who} (failed, exited or stalled): {_reason(exc)}"
        ) from exc


def _missing(ranks: tuple[int, ...], seq: int, timeout: float) -> list[int] | None:
    """The ranks that did not mark themselves within a grace period, or None without a store."""
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"reshard/joined/{','.join(map(str, ranks[:8]))}/{len(ranks)}/{seq}/"
        store.set(prefix + str(dist.get_rank()), b"1")
        deadline = time.monotonic() + min(timeout, _GRACE)
        while True:
            missing = [r for r in ranks if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.05)
    except Exception:  # no default store (or it failed): say only that someone is missing
        return None


def _reason(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
