"""The agreement round: one tiny all-gather before every ``refit`` and ``prepare``.

It tells every rank, from every rank's own view: whether the cached session is still valid
everywhere (a change on any rank makes every rank rebuild, never a stale plan), which ranks pass a
source and a destination model, each rank's model format codes (``build.sides.format_code``) and
its option digests (``exchange.options``), so that every rank raises the same error on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..refit_group import view_of
from . import bounded


@dataclass(frozen=True)
class Agreement:
    """What every rank learnt from the round (the same on every rank)."""

    valid: bool
    """The cached session is valid on every rank."""
    sides: tuple[tuple[int, ...], tuple[int, ...]]
    """The global ranks passing a source model, and those passing a destination model."""
    codes: dict[int, tuple[int, int]]
    """Each rank's ``(source, destination)`` format codes, by global rank."""
    digests: dict[int, tuple[int, ...]]
    """Each rank's option digests, by global rank."""


def agree(
    valid: bool,
    has_src: bool,
    has_dst: bool,
    codes: tuple[int, int],
    digests: tuple[int, ...],
    group,
    timeout: float | None,
) -> Agreement:
    """Share this rank's flags, format ``codes`` and option ``digests`` with every rank of ``group``.
    Collective; bounded by ``timeout`` when given (``TransportError`` naming the refit's start)."""
    view = view_of(group)
    device = "cuda" if view.backend == "nccl" else "cpu"
    flags = [int(valid), int(has_src), int(has_dst), *codes, *digests]
    mine = torch.tensor(flags, dtype=torch.int32, device=device)
    ranks = view.ranks
    gathered = torch.empty(len(flags) * len(ranks), dtype=torch.int32, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = gather(gathered, mine, group=view.pg, async_op=True)
    bounded.wait(work, timeout, group, "refit could not start")
    rows = dict(zip(ranks, gathered.view(len(ranks), len(flags)).cpu().tolist(), strict=True))
    return Agreement(
        valid=all(f[0] for f in rows.values()),
        sides=(tuple(r for r, f in rows.items() if f[1]), tuple(r for r, f in rows.items() if f[2])),
        codes={r: (f[3], f[4]) for r, f in rows.items()},
        digests={r: tuple(f[5:]) for r, f in rows.items()},
    )
