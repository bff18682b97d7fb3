"""Model configs of the catalogue (plain dataclasses; importing this module imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    """Multi-latent attention (DeepSeek-V3, Kimi-K2)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated delta-net layers (Qwen3-Next): every ``full_every``-th layer is full attention."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    full_every: int

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` is a delta-net layer (the others are gated full attention)."""
        return (layer + 1) % self.full_every != 0


@dataclass(frozen=True)
class GPTConfig:
    """A catalogue model: the shapes of its weights, and its HF family (``family``: the HF
    ``model_type``; "" picks Llama, Qwen3 or Qwen3-MoE from the shapes)."""

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
    experts_per_token: int = 0
    moe_ffn: int = 0
    first_dense_layers: int = 0  # layers [0, k) use a dense MLP in a MoE model
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE / Qwen3-Next: the shared expert's sigmoid gate [1, H]
    expert_bias: bool = False
    mla: MLAConfig | None = None
    linear_attention: LinearAttentionConfig | None = None
    qkv_bias: bool = False
    linear_bias: bool = False  # GPT-OSS: o_proj, experts' and the router's biases
    sinks: bool = False  # GPT-OSS: learned softmax offsets, one per head
    tied: bool = False
    family: str = ""
