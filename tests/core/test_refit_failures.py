"""A rank that dies or stalls in the middle of ``refit`` makes every other rank raise ``TransportError``
naming it, within ``refit(..., timeout=...)`` (3-rank Gloo worlds; rank 0 is the only source).

Rank 0 does one good refit, then breaks inside the second one, after every rank agreed to start it:
its transport's ``start()`` is replaced (in that process only) by ``os._exit`` or by a sleep longer
than the timeout.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from three_ranks import models

from reshard_core.errors import TransportError
from reshard_core.testing.world import WorldError, run_world

pytestmark = pytest.mark.slow

TIMEOUT = 2.0


def _break_rank0(how: str) -> None:
    from reshard_gloo.transport import GlooCopyService

    original = GlooCopyService.start

    def start(self):
        if how == "kill":
            os._exit(3)
        time.sleep(TIMEOUT + 4)
        return original(self)

    GlooCopyService.start = start


def _world(rank: int, world: int, how: str):
    import reshard_core

    src, dst = models(rank)
    reshard_core.refit(src, dst, timeout=TIMEOUT)
    good = dst is None or torch.equal(dst.w, torch.arange(32.0).reshape(8, 4)[4 * (rank - 1) : 4 * rank])
    if rank == 0:
        _break_rank0(how)
    assert good, "the first refit was not exact"
    if how == "kill":  # rank 0 never returns, so the others report through their errors
        reshard_core.refit(src, dst, timeout=TIMEOUT)
        return None
    try:
        reshard_core.refit(src, dst, timeout=TIMEOUT)
    except TransportError as exc:
        return str(exc)
    return None


def _expected(rank: int, reason: str) -> str:
    task = rank  # batch 0, from rank 0, to this rank
    where = f"transport 'gloo' (plugin reshard-gloo): rank {rank}, batch 0"
    return f"{where}: gloo: recv from rank 0 (task {task}, 64 bytes) failed: {reason}"


def test_a_stalled_rank_makes_every_peer_raise_within_the_timeout_naming_it():
    results = run_world(_world, 3, "stall", timeout=120, pg_timeout=60)
    for rank in (1, 2):
        assert results[rank] == _expected(rank, f"timed out after {TIMEOUT:g} s")
    stalled = results[0]  # the stalled rank itself fails once it wakes: its peers gave up
    assert "gloo: " in stalled and "send to rank 1 (task 1, 64 bytes)" in stalled
    assert stalled.endswith("connection closed by the peer (it exited, failed or gave up)")


def test_a_killed_rank_makes_every_peer_raise_naming_it():
    with pytest.raises(WorldError) as info:
        run_world(_world, 3, "kill", timeout=120, pg_timeout=60)
    text = str(info.value)
    assert "ranks 0 (exit code 3) died without reporting" in text
    for rank in (1, 2):
        section = text.split(f"rank {rank} failed:\n", 1)[1].splitlines()[0]
        reason = "connection closed by the peer (it exited, failed or gave up)"
        # rank 0 also hosted the store: reading the failure board then says so, naming it again
        where = f"transport 'gloo' (plugin reshard-gloo): rank {rank}, batch 0"
        gone = (
            f"{where}: rank {rank}: gloo: recv from rank 0 (task {rank}, 64 bytes): the group's store "
            "(hosted by rank 0) is gone ("
        )
        assert section == f"TransportError: {_expected(rank, reason)}" or section.startswith(
            f"TransportError: {gone}"
        ), section
