"""Delta refits over ``nccl`` with CUDA tensors (needs two CUDA GPUs: NCCL refuses two ranks on one).

Rank 0 holds a BF16 matrix and vector on its GPU, rank 1 their copies on its own; the source
changes sparsely between refits. Every refit is exact; after the first (whole), the deltas
(encoded and applied on the GPU, the rounds' small tensors on the GPU) move a small share of the
bytes, and the snapshot rank 0 keeps is on its GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]

STEPS = 4


def _full(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    w, n = torch.randn(2048, 512, generator=gen), torch.randn(1000, generator=gen)
    for _ in range(step):
        w = w * (1 + 0.05 * (torch.rand(w.shape, generator=gen) < 0.01))
        n = n * (1 + 0.05 * (torch.rand(n.shape, generator=gen) < 0.01))
    return {"w": w.to(torch.bfloat16), "n": n.to(torch.bfloat16)}


def _world(rank: int, world: int) -> list:
    import reshard_core
    from reshard_core import declare_layout

    torch.cuda.set_device(rank)
    src = dst = None
    if rank == 0:
        src = nn.Module()
        for name, t in _full(0).items():
            setattr(src, name, nn.Parameter(t.cuda(), requires_grad=False))
            declare_layout(getattr(src, name), ranks=(0,), name=name)
    else:
        dst = nn.Module()
        for name, t in _full(0).items():
            setattr(dst, name, nn.Parameter(torch.zeros_like(t, device="cuda"), requires_grad=False))
            declare_layout(getattr(dst, name), ranks=(1,), name=name)
    out = []
    for step in range(STEPS):
        if src is not None:
            for name, t in _full(step).items():
                getattr(src, name).data.copy_(t.cuda())
        report = reshard_core.refit(src, dst, transport="nccl", delta=True, timeout=60)
        exact = True
        if dst is not None:
            full = _full(step)
            exact = torch.equal(dst.w.cpu(), full["w"]) and torch.equal(dst.n.cpu(), full["n"])
        d = report.delta
        out.append((exact, report.bytes_sent, d.full_bytes, d.messages, d.held_bytes))
    return out


def test_delta_refits_over_nccl_are_exact_and_small():
    sender, receiver = run_world(_world, 2, timeout=300)
    assert [r[0] for r in receiver] == [True] * STEPS
    assert sender[0][1] == sender[0][2] and sender[0][3] == 0
    assert all(r[3] > 0 and r[1] < r[2] / 10 for r in sender[1:]), sender
    assert sender[-1][4] == sender[-1][2]
