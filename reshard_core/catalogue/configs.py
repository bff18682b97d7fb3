"""Model configs of the catalogue (plain dataclasses; importing this module imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class GPTConfig:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int | None = None  # default hidden // heads
    qk_norm: bool = False
    experts: int = 0
    moe_ffn: int = 0
    first_dense_layers: int = 0  # layers [0, k) use a dense MLP in a MoE model
    shared_expert_ffn: int = 0
    expert_bias: bool = False
    mla: MLAConfig | None = None
    tied: bool = False
