"""Qwen3-Next (``qwen3_next``): gated delta-net linear attention (``layer_types`` "linear_attention")
and full attention with an output gate, then Qwen2-MoE's MLP (router, routed experts, one shared
expert with a sigmoid gate). Norms are stored zero-centred (``x · (1 + w)``) on every side that maps
it, so they move as stored.

vLLM, TP size ``T`` (``nk``/``nv`` key/value heads of the linear attention, ``dk``/``dv`` their
sizes, ``Kd = nk·dk``, ``Vd = nv·dv``):

- ``linear_attn.in_proj_qkvz`` / ``in_proj_ba``: HF's rows grouped per key head (``[q_g; k_g; v; z]``,
  ``[b; a]``); rank d holds its key heads' whole groups, a contiguous slice;
- ``linear_attn.conv1d.weight [Kd+Kd+Vd, 1, K]``: channels ``[Q | K | V]``, each split over TP;
- ``linear_attn.A_log`` (fp32) and ``dt_bias [nv]`` by value heads; ``norm.weight [dv]`` replicated;
  ``out_proj`` row-parallel;
- ``self_attn.qkv_proj``: HF's ``q_proj`` holds each head's query then its output gate (``2·head_dim``
  rows a head), kept so in vLLM's query part; ``q_norm``, ``k_norm`` replicated.

Megatron-Core 0.16.1 builds Qwen3-Next only with Transformer Engine (its hybrid layer spec asserts
it) and flash-linear-attention; its settings ``experimental_attention_variant="gated_delta_net"`` and
``attention_output_gate`` stay refused here (docs/formats-audit.md says why).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import FP32, get, head_dim
from .qwen2_moe import Qwen2Moe


class Qwen3Next(Qwen2Moe):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    megatron_settings = ()
    megatron_mapped = False

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        if c.layer_types[n] == "linear_attention":
            return self.vllm_linear_attention(b, c, f"{p}.linear_attn")
        h, hidden = head_dim(c), c.hidden_size
        heads, kv = c.num_attention_heads, get(c, "num_key_value_heads", c.num_attention_heads)
        a = f"{p}.self_attn"
        b.qkv_heads(f"{a}.qkv_proj", a, heads, kv, h, 2 * h, hidden, bias=bool(get(c, "qkv_bias", False)))
        b.row(f"{a}.o_proj", f"{a}.o_proj", hidden, heads * h)
        b.norm(f"{a}.q_norm", h)
        b.norm(f"{a}.k_norm", h)

    def vllm_linear_attention(self, b: VLLMBlocks, c: Any, a: str) -> None:
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        keys, values, hidden = nk * c.linear_key_head_dim, nv * c.linear_value_head_dim, c.hidden_size
        b.divided("linear_num_key_heads", nk)
        b.divided("linear_num_value_heads", nv)
        b.column(f"{a}.in_proj_qkvz", [(f"{a}.in_proj_qkvz", 2 * keys + 2 * values)], hidden)
        b.column(f"{a}.in_proj_ba", [(f"{a}.in_proj_ba", 2 * nv)], hidden)
        conv = (2 * keys + values, 1, c.linear_conv_kernel_dim)
        b.components(f"{a}.conv1d.weight", conv, (keys, keys, values))
        b.heads(f"{a}.A_log", f"{a}.A_log", nv, FP32)
        b.heads(f"{a}.dt_bias", f"{a}.dt_bias", nv)
        b.norm(f"{a}.norm", c.linear_value_head_dim)
        b.row(f"{a}.out_proj", f"{a}.out_proj", hidden, values)

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        la = cfg.linear_attention
        kinds = [
            "full_attention" if (n + 1) % la.full_every == 0 else "linear_attention"
            for n in range(cfg.layers)
        ]
        return SimpleNamespace(**vars(super().hf_config(cfg)), layer_types=kinds,
            linear_num_key_heads=la.key_heads, linear_num_value_heads=la.value_heads,
            linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
            linear_conv_kernel_dim=la.conv_kernel)  # fmt: skip


FAMILY = Qwen3Next()
