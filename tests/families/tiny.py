"""Tiny transformers configs of every family, sized for vLLM's CPU build and Megatron-Core on CPU.

Every config runs in vLLM 0.32's CPU engine at TP1 and TP2: hidden 128 and MoE intermediate sizes
whose TP2 halves are multiples of 32 (vLLM's CPU MoE pads them otherwise, which a reload cannot
refit), head sizes its CPU attention accepts, MLA's latent rank 512 and rope dim 64 (the only sizes
its CPU MLA kernels take), GPT-OSS's yarn rope parameters (vLLM always builds yarn for it), and an
explicit ``architectures`` (else vLLM may pick a pooling model). Vocab 512, 2 layers, untied head,
``float32`` unless a caller asks otherwise.

``hf_model(kind, seed)`` is the family's transformers model with seeded random weights (N(0, 0.02),
buffers included), the reference every test compares with.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

KINDS = ("deepseek_v3", "glm4_moe", "gpt_oss", "qwen2_moe", "qwen3_next")
"""The families these tests build (Llama and Qwen3-MoE have their own tests in ``tests/vllm``)."""

COMMON = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, dtype="float32",
)  # fmt: skip


def config(kind: str, **overrides: Any) -> Any:
    """The tiny transformers config of family ``kind``; ``overrides`` replace any field."""
    return _BUILDERS[kind](**overrides)


def _deepseek_v3(**overrides: Any) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**(COMMON | dict(
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_nextn_predict_layers=0, attention_bias=False, architectures=["DeepseekV3ForCausalLM"],
    ) | overrides))  # fmt: skip


def _glm4_moe(**overrides: Any) -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**(COMMON | dict(
        num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0, architectures=["Glm4MoeForCausalLM"],
    ) | overrides))  # fmt: skip


def _gpt_oss(**overrides: Any) -> Any:
    from transformers import GptOssConfig

    yarn = {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 256, "rope_theta": 10000.0}  # fmt: skip
    return GptOssConfig(**(COMMON | dict(
        num_key_value_heads=2, head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], rope_parameters=yarn,
        rms_norm_eps=1e-5, architectures=["GptOssForCausalLM"],
    ) | overrides))  # fmt: skip


def _qwen2_moe(**overrides: Any) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**(COMMON | dict(
        num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, architectures=["Qwen2MoeForCausalLM"],
    ) | overrides))  # fmt: skip


def _qwen3_next(**overrides: Any) -> Any:
    """bfloat16: vLLM's CPU delta-net kernels take nothing else; key and value heads of 64 (its prefill
    kernel takes 64 or 128 only)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**(COMMON | dict(
        num_key_value_heads=2, head_dim=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, dtype="bfloat16",
        layer_types=["linear_attention", "full_attention"], architectures=["Qwen3NextForCausalLM"],
    ) | overrides))  # fmt: skip


_BUILDERS = {
    "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss, "qwen2_moe": _qwen2_moe,
    "qwen3_next": _qwen3_next,
}  # fmt: skip

INIT_STD = 0.02


def hf_model(kind_or_config: Any, seed: int = 0, *, std: float = INIT_STD) -> Any:
    """The transformers model of a family (or of a config) with seeded random weights in the
    config's dtype, eval mode: parameters and persistent buffers from N(0, std), norms from 1 + N(0,
    std) (so a norm left at its old value shows), GPT-OSS sinks and routers' correction biases too."""
    from transformers import AutoModelForCausalLM

    cfg = config(kind_or_config) if isinstance(kind_or_config, str) else copy.deepcopy(kind_or_config)
    dtype = getattr(cfg, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "rotary" in name or name.endswith("inv_freq"):
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std
            base = 1.0 if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] else 0.0
            tensor.copy_((noise + base).to(tensor.dtype))
    return model


ROTARY_IN_TORCH = '{"custom_ops": ["-rotary_embedding"]}'
"""vLLM's CPU rotary kernel mis-rotates MLA's strided query and key views; the pure-torch rotary is exact."""

SERVER_ARGS: dict[str, list[str]] = {"deepseek_v3": ["--compilation-config", ROTARY_IN_TORCH]}
"""Extra ``vllm serve`` arguments per family."""

LLM_ARGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"compilation_config": {"custom_ops": ["-rotary_embedding"]}},
}
"""Extra ``vllm.LLM`` arguments per family."""

SEND_OPTIONS: dict[str, dict[str, Any]] = {"qwen3_next": {"cast": True}}
"""``send_weights`` options per family: vLLM keeps Qwen3-Next's ``A_log`` in fp32 in a bf16 engine."""

LOGPROB_ATOL: dict[str, float] = {"qwen3_next": 0.05}
"""Generation tolerances per family (nats; default 1e-3, float32): Qwen3-Next runs in bf16."""


def reference(kind: str, seed: int) -> Any:
    """The transformers model generation is checked against: ``hf_model(kind, seed)`` computing in
    float32 (the same weights; a bf16 engine's noise is then all that differs)."""
    return hf_model(kind, seed).float()


def dtype_name(kind: str) -> str:
    """The engine's dtype for family ``kind`` (its tiny config's)."""
    return str(config(kind).dtype).removeprefix("torch.")


def unmapped_config() -> Any:
    """A model vLLM's CPU build serves and no family maps (Phi-3: fused ``qkv_proj`` in its checkpoint)."""
    from transformers import Phi3Config

    return Phi3Config(**(COMMON | dict(num_key_value_heads=2, intermediate_size=256, pad_token_id=0,
                                       architectures=["Phi3ForCausalLM"])))  # fmt: skip
