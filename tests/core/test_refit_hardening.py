"""Usage errors a caller makes on some ranks only: one clear ``ReshardError`` on every rank, before any
data moves, and the world still usable afterwards (one 3-rank Gloo world runs every case in turn).

Rank 0 holds the source tensors ``a`` and ``b`` (8×4, distinct values); ranks 1 and 2 hold 4-row
halves of the destinations. Each case returns every rank's outcome: the error text, or ``"ok"``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

TIMEOUT = 5.0
A = torch.arange(32.0).reshape(8, 4)
B = 100 + torch.arange(32.0).reshape(8, 4)


def _models(rank: int):
    from reshard_core import declare_layout

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.a, src.b = nn.Parameter(A.clone()), nn.Parameter(B.clone())
        for t in (src.a, src.b):
            declare_layout(t, ranks=(0,))
    else:
        dst = nn.Module()
        dst.a, dst.b = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4, 4))
        for t in (dst.a, dst.b):
            declare_layout(t, dim=0, ranks=(1, 2))
    return src, dst


def _untouched(dst) -> bool:
    return dst is None or all(not p.any() for p in dst.parameters())


def _exact(rank: int, dst) -> bool:
    rows = slice(4 * (rank - 1), 4 * rank)
    return dst is None or (torch.equal(dst.a, A[rows]) and torch.equal(dst.b, B[rows]))


def _outcome(fn) -> str:
    from reshard_core.errors import ReshardError

    try:
        fn()
    except ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _case_options_differ(rank: int):
    import reshard_core

    src, dst = _models(rank)
    ignore = ("a",) if rank == 1 else ("b",)
    batch = 64 if rank == 2 else None
    text = _outcome(
        lambda: reshard_core.refit(src, dst, ignore=ignore, max_batch_bytes=batch, timeout=TIMEOUT)
    )
    untouched = _untouched(dst)
    after = _outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))
    return text, untouched, after, _exact(rank, dst)


CASES = {"options_differ": _case_options_differ}


def _world(rank: int, world: int, names: list[str]):
    return {name: CASES[name](rank) for name in names}


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_world(_world, 3, list(CASES), timeout=180)
    return {name: [r[name] for r in per_rank] for name in CASES}


def test_ranks_passing_different_plan_options_all_fail_naming_the_options_before_data_moves(outcomes):
    want = (
        "ReshardError: refit options differ across ranks: ignore (ranks [0, 2] vs ranks [1]); "
        "max_batch_bytes (ranks [0, 1] vs ranks [2]); every rank must pass the same ignore=, tied=, "
        "max_batch_bytes= and transport= (they shape the plan)"
    )
    assert outcomes["options_differ"] == [(want, True, "ok", True)] * 3
