"""Each refit brings every source up to date exactly once: a dequantized copy of a quantized param
(``reshard-mxfp8``'s TE sources) is a full pass over it, so doing it twice per refit costs time."""

from __future__ import annotations

import torch
from torch import nn

from reshard_core.testing.world import run_world


class _Counting:
    """A source refresher that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def refresh_source(self) -> None:
        self.calls += 1


def _world(rank: int, world: int) -> dict:
    import reshard_core

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    src, dst = nn.Module(), nn.Module()
    src.w = nn.Parameter(full.chunk(world, 0)[rank].clone(), requires_grad=False)
    dst.w = nn.Parameter(torch.zeros(8, 6 // world), requires_grad=False)
    reshard_core.declare_layout(src.w, dim=0)
    reshard_core.declare_layout(dst.w, dim=1)
    session = reshard_core.prepare(src, dst, timeout=30)
    counter = _Counting()
    session.refreshers.append(counter)
    calls = []
    for _ in range(3):
        session.refit()
        calls.append(counter.calls)
    reshard_core.refit(src, dst, timeout=30)  # the cached session, through the agreeing path
    calls.append(counter.calls)
    return {"calls": calls, "exact": torch.equal(dst.w, full.chunk(world, 1)[rank])}


def test_a_prepared_refit_and_a_cached_one_refresh_each_source_once():
    for out in run_world(_world, 2, timeout=120):
        assert out == {"calls": [1, 2, 3, 4], "exact": True}
