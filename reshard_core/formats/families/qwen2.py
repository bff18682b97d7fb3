"""Qwen2 / Qwen2.5 (``qwen2``): a Llama whose q/k/v projections always have biases (``o_proj`` none)."""

from __future__ import annotations

from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import Family, get, head_dim


class Qwen2(Family):
    name = "qwen2"
    title = "Qwen2, Qwen2.5"
    model_types = ("qwen2",)

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        h = head_dim(c)
        heads, kv = c.num_attention_heads, get(c, "num_key_value_heads", c.num_attention_heads)
        b.qkv(f"{p}.self_attn.qkv_proj", f"{p}.self_attn", heads, kv, h, c.hidden_size, bias=True)
        b.row(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", c.hidden_size, heads * h)


FAMILY = Qwen2()
