"""``MasterWeights``: the RL trainer's update pattern, for tests and benchmarks of delta refits.

A trainer keeps FP32 master weights and a low-precision (BF16) model copy; each step an optimizer
updates the masters and the copy is refreshed from them, so most copies round to the same value
after a small step. Gradients are random (seeded per instance): what changes is realistic, no data
or loss is needed.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """FP32 masters of ``model``'s local tensors (a DTensor's local shard), stepped by AdamW."""

    def __init__(self, model: torch.nn.Module, lr: float, seed: int = 0) -> None:
        self.locals = [getattr(p, "_local_tensor", p).data for p in model.parameters()]
        self.masters = [t.float().clone().requires_grad_() for t in self.locals]
        self.opt = torch.optim.AdamW(self.masters, lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, lr: float | None = None) -> None:
        """One AdamW step with N(0, 1) gradients (at ``lr`` when given), then refresh the model."""
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        for master in self.masters:
            master.grad = torch.randn(master.shape, generator=self.gen)
        self.opt.step()
        with torch.no_grad():
            for local, master in zip(self.locals, self.masters, strict=True):
                local.copy_(master)
