"""Qwen2-MoE (``qwen2_moe``, Qwen1.5-MoE / Qwen2-57B-A14B): Qwen2 attention (q/k/v biases); MoE
layers with a router, routed experts and one shared expert scaled by a sigmoid gate.

vLLM: ``mlp.gate`` and ``mlp.shared_expert_gate [1, H]`` replicated, ``mlp.shared_expert.gate_up_proj``
/ ``down_proj`` TP-split like a dense MLP, experts in ``FusedMoE``. Megatron names the one shared
expert ``mlp.shared_experts.*`` and its gate ``shared_experts.gate_weight``
(``moe_shared_expert_gate=True``, which picks this family's names).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import get
from .qwen2 import Qwen2
from .qwen3_moe import sparse


class Qwen2Moe(Qwen2):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)

    megatron_settings = (("moe_shared_expert_gate", True),)
    megatron_names = {"mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight"}
    megatron_shared_expert = "mlp.shared_expert."

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        if not sparse(c, n):
            return super().vllm_mlp(b, c, n, p)
        hidden = c.hidden_size
        b.replicated(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (c.num_experts, hidden))
        b.experts(f"{p}.mlp.experts", f"{p}.mlp.experts", c.num_experts, c.moe_intermediate_size, hidden)
        shared = get(c, "shared_expert_intermediate_size", 0)
        if shared:
            b.mlp(f"{p}.mlp.shared_expert", f"{p}.mlp.shared_expert", shared, hidden)
            gate = f"{p}.mlp.shared_expert_gate.weight"
            b.replicated(gate, gate, (1, hidden))

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        return SimpleNamespace(
            **vars(super().hf_config(cfg)), shared_expert_intermediate_size=cfg.shared_expert_ffn
        )


FAMILY = Qwen2Moe()
