"""Megatron-Core GPT parameter names and shapes from a model config (local layer spec names).

Covers dense and MoE layers, grouped-query attention (``linear_qkv`` packs Q, K, V per query group,
so a contiguous TP split by groups is right), optional Q/K layernorm, gated MLPs (``linear_fc1``
holds [gate; up], TP ``partition_stride=2``), shared experts (and Qwen2-MoE's gate), the router's
fp32 ``expert_bias``, multi-latent attention (``MLASelfAttention`` with the local spec: down/up
projections are column-parallel, ``linear_proj`` row-parallel), q/k/v biases, GPT-OSS's biases (the
router's, the experts', ``linear_proj``'s) and learned softmax offsets (one per head, split over TP
by heads), and Qwen3-Next's layers: gated delta-net (``GatedDeltaNet``: ``in_proj`` and ``conv1d``
column-parallel, ``dt_bias``/``A_log`` by value heads, ``out_proj`` row-parallel) and full attention
whose ``linear_qkv`` also holds the output gates.
"""

from __future__ import annotations

import torch

from .configs import GPTConfig, MLAConfig
from .shapes import ModelShapes, ShapeEntry

__all__ = ["GPTConfig", "MLAConfig", "gpt_shapes"]

BF16 = torch.bfloat16


def gpt_shapes(cfg: GPTConfig) -> ModelShapes:
    """Every weight of a Megatron GPTModel built from ``cfg``, with global names."""
    h = cfg.hidden
    out = [ShapeEntry("embedding.word_embeddings.weight", (cfg.vocab, h), BF16, "vocab", -1)]
    for layer in range(cfg.layers):
        p = f"decoder.layers.{layer}."

        def add(suffix, shape, kind="replicated", dtype=BF16, expert=None, p=p, layer=layer):
            out.append(ShapeEntry(p + suffix, shape, dtype, kind, layer, expert))

        add("input_layernorm.weight", (h,))
        if cfg.linear_attention is not None and cfg.linear_attention.is_linear(layer):
            _delta_net(cfg, add)
        else:
            _attention(cfg, add)
        add("pre_mlp_layernorm.weight", (h,))
        if cfg.experts and layer >= cfg.first_dense_layers:
            _moe(cfg, add)
        else:
            _mlp(cfg, add, "mlp.", cfg.ffn)
    out.append(ShapeEntry("decoder.final_layernorm.weight", (h,), BF16, "replicated", cfg.layers))
    if not cfg.tied:
        out.append(ShapeEntry("output_layer.weight", (cfg.vocab, h), BF16, "vocab", cfg.layers))
    return ModelShapes(cfg.name, tuple(out), cfg.layers, cfg.heads, cfg.kv_heads)


def _attention(cfg: GPTConfig, add) -> None:
    h = cfg.hidden
    if cfg.mla is not None:
        m = cfg.mla
        q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        add("self_attention.linear_q_down_proj.weight", (m.q_lora_rank, h), "column")
        add("self_attention.q_layernorm.weight", (m.q_lora_rank,))
        add("self_attention.linear_q_up_proj.weight", (cfg.heads * q_head, m.q_lora_rank), "column")
        add("self_attention.linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), "column")
        add("self_attention.kv_layernorm.weight", (m.kv_lora_rank,))
        kv_up = cfg.heads * (m.qk_nope_head_dim + m.v_head_dim)
        add("self_attention.linear_kv_up_proj.weight", (kv_up, m.kv_lora_rank), "column")
        add("self_attention.linear_proj.weight", (h, cfg.heads * m.v_head_dim), "row")
        return
    hd = cfg.head_dim or h // cfg.heads
    gates = cfg.heads if cfg.linear_attention is not None else 0  # Qwen3-Next gates every head
    add("self_attention.linear_qkv.weight", ((cfg.heads + gates + 2 * cfg.kv_heads) * hd, h), "column")
    if cfg.qkv_bias:
        add("self_attention.linear_qkv.bias", ((cfg.heads + 2 * cfg.kv_heads) * hd,), "column")
    if cfg.qk_norm:
        add("self_attention.q_layernorm.weight", (hd,))
        add("self_attention.k_layernorm.weight", (hd,))
    if cfg.sinks:
        add("self_attention.core_attention.softmax_offset", (cfg.heads,), "column")
    add("self_attention.linear_proj.weight", (h, cfg.heads * hd), "row")
    if cfg.linear_bias:
        add("self_attention.linear_proj.bias", (h,))


def _delta_net(cfg: GPTConfig, add) -> None:
    la = cfg.linear_attention
    keys, values = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
    add("self_attention.in_proj.weight", (2 * (keys + values + la.value_heads), cfg.hidden), "column")
    add("self_attention.conv1d.weight", (2 * keys + values, 1, la.conv_kernel), "column")
    add("self_attention.dt_bias", (la.value_heads,), "column")
    add("self_attention.A_log", (la.value_heads,), "column")
    add("self_attention.out_norm.weight", (la.value_head_dim,))
    add("self_attention.out_proj.weight", (cfg.hidden, values), "row")


def _mlp(cfg: GPTConfig, add, prefix: str, ffn: int, expert: int | None = None) -> None:
    """A gated MLP (``linear_fc1`` [gate; up], ``linear_fc2``), with biases for ``linear_bias``."""
    add(f"{prefix}linear_fc1.weight", (2 * ffn, cfg.hidden), "strided", expert=expert)
    add(f"{prefix}linear_fc2.weight", (cfg.hidden, ffn), "row", expert=expert)
    if cfg.linear_bias:
        add(f"{prefix}linear_fc1.bias", (2 * ffn,), "strided", expert=expert)
        add(f"{prefix}linear_fc2.bias", (cfg.hidden,), expert=expert)


def _moe(cfg: GPTConfig, add) -> None:
    h = cfg.hidden
    add("mlp.router.weight", (cfg.experts, h))
    if cfg.linear_bias:
        add("mlp.router.bias", (cfg.experts,))
    if cfg.expert_bias:
        add("mlp.router.expert_bias", (cfg.experts,), dtype=torch.float32)
    for e in range(cfg.experts):
        _mlp(cfg, add, f"mlp.experts.local_experts.{e}.", cfg.moe_ffn, expert=e)
    if cfg.shared_expert_ffn:
        _mlp(cfg, add, "mlp.shared_experts.", cfg.shared_expert_ffn)
    if cfg.shared_expert_gate:
        add("mlp.shared_experts.gate_weight", (1, h))
