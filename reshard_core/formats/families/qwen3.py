"""Qwen3 (``qwen3``): a Llama with per-head q/k RMSNorms (``self_attn.{q,k}_norm [head_dim]``).

``attention_bias`` gives q/k/v biases in vLLM (which builds ``o_proj`` without one). Megatron:
``qk_layernorm=True`` (``self_attention.{q,k}_layernorm``, the shared table's names).
"""

from __future__ import annotations

from typing import Any

from .family import Family, get


class Qwen3(Family):
    name = "qwen3"
    model_types = ("qwen3",)

    def attention_biases(self, c: Any) -> tuple[bool, bool]:
        return bool(get(c, "attention_bias", False)), False

    def qk_norms(self, c: Any) -> bool:
        return True


FAMILY = Qwen3()
