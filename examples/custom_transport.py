"""Quick start: plug in your own transport (a ``reshard_core.CopyService``) and refit through it.

Run it as it is (2-process Gloo world on loopback; CPU only)::

    python examples/custom_transport.py

A transport moves contiguous buffers between global ranks and knows nothing of models: queue
``submit_send`` / ``submit_recv`` calls, move them all in ``run()``. Two-sided transports pair a
rank's n-th send to a peer with that peer's n-th receive from the rank (submission order), so
``task_id`` may be ignored. Pass an instance to ``refit(transport=...)``, or ship it as a plugin
(entry point ``reshard.transports``, see the README) and pass its name. Check it with
``reshard_core.testing.conformance.run_conformance(YourCopyService)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import reshard_core
from reshard_core.testing.models import build_fsdp_mlp, build_tp_mlp
from reshard_core.testing.world import run_world

WORLD = 2


class BatchedP2PCopyService(reshard_core.CopyService):
    """torch.distributed point-to-point ops, all of a round issued as one ``batch_isend_irecv``."""

    name = "batched-p2p"
    device = "cpu"  # where submitted tensors may live

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None) -> None:
        super().__init__(group, timeout=timeout)
        self.ops: list[dist.P2POp] = []
        self.messages = 0

    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        self.ops.append(dist.P2POp(dist.isend, tensor, dest_rank, self.group))

    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        self.ops.append(dist.P2POp(dist.irecv, tensor, src_rank, self.group))

    def run(self) -> None:
        ops, self.ops = self.ops, []
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.messages += sum(op.op is dist.isend for op in ops)

    def close(self) -> None:
        self.ops.clear()


def step(rank: int, world: int) -> bool:
    """One rank: refit an FSDP2 model into a TP model through the custom transport; True when exact."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    train, infer = build_fsdp_mlp(mesh, seed=1, ffn=64), build_tp_mlp(mesh, seed=2, ffn=64)
    transport = BatchedP2PCopyService()
    report = reshard_core.refit(train, infer, transport=transport)
    print(f"rank {rank}: {transport.messages} messages through {transport.name}; {report}")
    wanted, got = dict(train.state_dict()), dict(infer.state_dict())
    equal = all(torch.equal(_full(wanted[n]), _full(got[n])) for n in sorted(wanted))
    dist.barrier()
    return transport.messages > 0 and equal


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


if __name__ == "__main__":
    results = run_world(step, WORLD, timeout=120)
    print("verified: every weight equal on every rank" if all(results) else "MISMATCH")
    raise SystemExit(0 if all(results) else 1)
