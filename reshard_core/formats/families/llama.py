"""Llama and Mistral (``llama``, ``mistral``): GQA attention, a gated SiLU MLP, RMSNorm.

vLLM: ``qkv_proj`` (with ``attention_bias``: q/k/v biases, and an ``o_proj`` bias), ``gate_up_proj``
(with ``mlp_bias``: biases on all three projections). Megatron and transformers: the shared names.
"""

from __future__ import annotations

from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import Family, get


class Llama(Family):
    name = "llama"
    model_types = ("llama", "mistral")

    def attention_biases(self, c: Any) -> tuple[bool, bool]:
        bias = bool(get(c, "attention_bias", False))
        return bias, bias

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        bias = bool(get(c, "mlp_bias", False))
        b.mlp(f"{p}.mlp", f"{p}.mlp", c.intermediate_size, c.hidden_size, bias=bias)


FAMILY = Llama()
