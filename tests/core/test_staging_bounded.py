"""Bounded memory: the staging pool keeps at most what staging needed at its peak, however many
distinct message sizes a plan has (contract 4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.execute.pool import SLACK, StagingPool
from reshard_core.testing.world import run_world

N = 100
BUDGET = 1 << 20


def test_distinct_sizes_share_buffers_and_the_free_list_stays_under_the_peak():
    pool = StagingPool()
    prev = None
    for k in range(N):  # the executor's pattern: take for batch k, give back batch k-1
        buf = pool.take(1000 * (k + 1), torch.device("cpu"))
        assert buf.numel() == 1000 * (k + 1)
        if prev is not None:
            pool.give(prev)
        prev = buf
    pool.give(prev)
    assert pool.out_bytes == 0
    assert pool.held_bytes <= pool.peak_out <= 2 * (1000 * N + SLACK)


def test_a_small_request_does_not_tie_up_a_huge_buffer():
    pool = StagingPool()
    pool.give(pool.take(10 * SLACK, torch.device("cpu")))
    small = pool.take(100, torch.device("cpu"))
    assert small._base is None and small.numel() == 100  # a fresh buffer, not a slice of the big one
    big = pool.take(9 * SLACK, torch.device("cpu"))
    assert big._base is not None and big._base.numel() == 10 * SLACK


def _models(rank: int):
    from reshard_core import declare_layout

    src = dst = None
    if rank == 0:
        src = nn.Module()
        for k in range(N):
            src.register_buffer(f"t{k:03d}", torch.arange(1000.0 * (k + 1)))
            declare_layout(getattr(src, f"t{k:03d}"), ranks=(0,))
    else:
        dst = nn.Module()
        for k in range(N):
            dst.register_buffer(f"t{k:03d}", torch.zeros(1000 * (k + 1)))
            declare_layout(getattr(dst, f"t{k:03d}"), ranks=(1,))
    return src, dst


def _world(rank: int, world: int):
    import reshard_core

    src, dst = _models(rank)
    session = reshard_core.prepare(src, dst, max_batch_bytes=BUDGET, timeout=60)
    out = []
    for _ in range(3):
        report = session.refit()
        out.append((report.batches, report.peak_staging_bytes, session.pool.held_bytes))
    exact = dst is None or all(
        torch.equal(getattr(dst, f"t{k:03d}"), torch.arange(1000.0 * (k + 1))) for k in range(N)
    )
    return out, exact


@pytest.mark.slow
def test_staging_held_across_refits_is_bounded_by_the_peak_not_by_the_model():
    results = run_world(_world, 2, timeout=240, pg_timeout=60)
    for rank in (0, 1):
        refits, exact = results[rank]
        assert exact
        batches, peak, held = refits[0]
        assert batches > 10  # many distinct message sizes
        assert 0 < peak <= 3 * BUDGET
        for _, _, later in refits:
            assert later <= 2 * peak + SLACK  # was the sum of every batch's message (~20 MB)
        assert refits[1][2] == refits[2][2]  # steady state: nothing new kept
