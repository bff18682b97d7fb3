"""Quick start: refit an FSDP2 training model into a DTensor tensor-parallel inference model.

Run it as it is (it spawns a 2-process Gloo world on loopback; CPU only)::

    python examples/fsdp2_to_dtensor_tp.py

In your own job the body of ``step`` is all you need: one process per rank (torchrun or your
launcher), ``dist.init_process_group``, your two models, and ``reshard_core.refit``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import reshard_core
from reshard_core.testing.models import build_fsdp_mlp, build_tp_mlp
from reshard_core.testing.world import run_world

WORLD = 2


def step(rank: int, world: int) -> bool:
    """One rank: build both models, refit, check every weight; True when all are equal."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    train = build_fsdp_mlp(mesh, seed=1, ffn=64)  # FSDP2: every param a Shard(0) DTensor
    infer = build_tp_mlp(mesh, seed=2, ffn=64)  # DTensor TP: fc1 colwise, fc2 rowwise
    report = reshard_core.refit(train, infer, transport="gloo")
    if rank == 0:
        print(report)
    wanted, got = dict(train.state_dict()), dict(infer.state_dict())
    equal = all(torch.equal(_full(wanted[n]), _full(got[n])) for n in sorted(wanted))
    dist.barrier()
    return equal


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


if __name__ == "__main__":
    results = run_world(step, WORLD, timeout=120)
    print("verified: every weight equal on every rank" if all(results) else "MISMATCH")
    raise SystemExit(0 if all(results) else 1)
