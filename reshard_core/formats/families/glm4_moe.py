"""GLM-4.5 / 4.6 (``glm4_moe``): GQA attention with q/k/v biases (``attention_bias``), optional per-head
q/k norms (``use_qk_norm``) and partial rotary (``partial_rotary_factor``, 0.5: the first half of each
head, rotated in halves as Megatron's ``rotary_percent`` does, so no row moves); dense first layers
(``first_k_dense_replace``), then DeepSeek-V3's MoE layers (sigmoid router and correction bias, both
fp32 in vLLM, ungated shared experts).

Megatron: ``add_qkv_bias=True``, ``qk_layernorm``, ``rotary_percent=0.5`` (a ``GPTModel`` argument with no
weight: the two sides must agree), ``moe_router_enable_expert_bias``; the shared names.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..vllm_blocks import VLLMBlocks
from .deepseek_v3 import moe_layer, moe_with_shared_experts, with_sigmoid_moe
from .family import FP32, Family, get


class Glm4Moe(Family):
    name = "glm4_moe"
    model_types = ("glm4_moe",)

    def attention_biases(self, c: Any) -> tuple[bool, bool]:
        return bool(get(c, "attention_bias", False)), False

    def qk_norms(self, c: Any) -> bool:
        return bool(get(c, "use_qk_norm", False))

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        if moe_layer(c, n):
            moe_with_shared_experts(b, c, p, correction_bias=True, gate_dtype=FP32)
        else:
            super().vllm_mlp(b, c, n, p)

    def experts(self, c: Any) -> int:
        return get(c, "n_routed_experts", 0)

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        return with_sigmoid_moe(super().hf_config(cfg), cfg, use_qk_norm=cfg.qk_norm)


FAMILY = Glm4Moe()
