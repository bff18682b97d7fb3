"""Qwen3 (``qwen3``): a Llama with per-head q/k RMSNorms (``self_attn.{q,k}_norm [head_dim]``).

``attention_bias`` gives q/k/v biases in vLLM (which builds ``o_proj`` without one). Megatron:
``qk_layernorm=True`` (``self_attention.{q,k}_layernorm``, the shared table's names).
"""

from __future__ import annotations

from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import Family, get, head_dim


class Qwen3(Family):
    name = "qwen3"
    title = "Qwen3 (dense)"
    model_types = ("qwen3",)

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        h = head_dim(c)
        heads, kv = c.num_attention_heads, get(c, "num_key_value_heads", c.num_attention_heads)
        bias = bool(get(c, "attention_bias", False))
        b.qkv(f"{p}.self_attn.qkv_proj", f"{p}.self_attn", heads, kv, h, c.hidden_size, bias=bias)
        b.row(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", c.hidden_size, heads * h)
        b.norm(f"{p}.self_attn.q_norm", h)
        b.norm(f"{p}.self_attn.k_norm", h)


FAMILY = Qwen3()
