"""Llama and Mistral (``llama``, ``mistral``): GQA attention, a gated SiLU MLP, RMSNorm.

vLLM: ``qkv_proj`` (with ``attention_bias``: q/k/v biases, and an ``o_proj`` bias), ``gate_up_proj``
(with ``mlp_bias``: biases on all three projections). Megatron and transformers: the shared names.
"""

from __future__ import annotations

from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import Family, get, head_dim


class Llama(Family):
    name = "llama"
    title = "Llama 2/3, Mistral"
    model_types = ("llama", "mistral")

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        h, bias = head_dim(c), bool(get(c, "attention_bias", False))
        heads, kv = c.num_attention_heads, get(c, "num_key_value_heads", c.num_attention_heads)
        b.qkv(f"{p}.self_attn.qkv_proj", f"{p}.self_attn", heads, kv, h, c.hidden_size, bias=bias)
        b.row(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", c.hidden_size, heads * h, bias=bias)

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        b.mlp(
            f"{p}.mlp", f"{p}.mlp", c.intermediate_size, c.hidden_size, bias=bool(get(c, "mlp_bias", False))
        )


FAMILY = Llama()
