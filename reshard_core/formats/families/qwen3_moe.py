"""Qwen3-MoE (``qwen3_moe``): Qwen3 attention; MoE layers with a router and routed experts only.

A layer is MoE when ``num_experts > 0``, it is not in ``mlp_only_layers`` and ``(n + 1)`` is a
multiple of ``decoder_sparse_step``; the others have Qwen3's dense MLP. vLLM: ``mlp.gate`` (replicated
router) and ``mlp.experts.w13_weight`` / ``w2_weight`` (``FusedMoE``).
"""

from __future__ import annotations

from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import get
from .qwen3 import Qwen3


def sparse(c: Any, n: int) -> bool:
    """Whether layer ``n`` of a Qwen-MoE config is an MoE layer."""
    step = get(c, "decoder_sparse_step", 1)
    return (
        bool(get(c, "num_experts", 0))
        and n not in (get(c, "mlp_only_layers", ()) or ())
        and (n + 1) % step == 0
    )


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        if not sparse(c, n):
            return super().vllm_mlp(b, c, n, p)
        b.replicated(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (c.num_experts, c.hidden_size))
        b.experts(
            f"{p}.mlp.experts", f"{p}.mlp.experts", c.num_experts, c.moe_intermediate_size, c.hidden_size
        )


FAMILY = Qwen3Moe()
