"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (``deepseek_v3``, ``kimi_k2``): multi-latent attention (MLA),
dense first layers, then MoE layers with a sigmoid router, its fp32 correction bias, routed experts
and ungated shared experts.

MLA (``N`` heads, ``P`` nope / ``R`` rope / ``V`` value head dims, ``Lq`` q rank, ``L`` kv rank):

=====================================  ==========================  =====================================
Megatron ``self_attention.``           HF ``self_attn.``           vLLM ``self_attn.``
=====================================  ==========================  =====================================
``linear_q_down_proj`` [Lq, H]         ``q_a_proj``                rows ``[0, Lq)`` of ``fused_qkv_a_proj``
``linear_kv_down_proj`` [L+R, H]       ``kv_a_proj_with_mqa``      rows ``[Lq, Lq+L+R)`` of it (replicated)
``q_layernorm`` / TE ``linear_q_up_    ``q_a_layernorm``           ``q_a_layernorm``
proj.layer_norm_weight``
``kv_layernorm`` / TE ``linear_kv_     ``kv_a_layernorm``          ``kv_a_layernorm``
up_proj.layer_norm_weight``
``linear_q_up_proj`` [N(P+R), Lq]      ``q_b_proj``                ``q_b_proj`` (column, by heads)
``linear_q_proj`` (no q rank)          ``q_proj``                  ``q_proj``; ``kv_a_proj_with_mqa`` apart
``linear_kv_up_proj`` [N(P+V), L]      ``kv_b_proj``               ``kv_b_proj`` (column, by heads)
``linear_proj``                        ``o_proj``                  ``o_proj`` (row)
=====================================  ==========================  =====================================

Megatron, HF (``rope_interleave=True``, its default) and vLLM rotate the rope slice as even/odd pairs,
so no row moves. Megatron's local spec splits the down projections over TP, its TE spec replicates
them: the extractor says which. vLLM derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` after loading;
reshard-vllm has them derived again with every update. A layer is MoE from ``first_k_dense_replace``
on, every ``moe_layer_freq``-th; vLLM creates ``mlp.gate.e_score_correction_bias`` (fp32) only with
``topk_method="noaux_tc"``. Multi-token-prediction layers are ``model.layers.{N + k}`` (Megatron's
``mtp.layers.k``, the shared table); vLLM's main model holds none.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..vllm_blocks import VLLMBlocks
from .family import FP32, Family, get


def moe_layer(c: Any, n: int) -> bool:
    """Whether layer ``n`` of a DeepSeek-V3 (or GLM-4.5) config is an MoE layer."""
    return (
        bool(get(c, "n_routed_experts", 0))
        and n >= get(c, "first_k_dense_replace", 0)
        and (n % get(c, "moe_layer_freq", 1) == 0)
    )


def moe_with_shared_experts(
    b: VLLMBlocks, c: Any, p: str, *, correction_bias: bool, gate_dtype: Any = None
) -> None:
    """A sigmoid-routed MoE layer (``p``: ``model.layers.{n}``): the router ``mlp.gate`` (``gate_dtype``:
    kept so whatever the model's), its fp32 correction bias (when ``correction_bias``), ungated shared
    experts, routed experts."""
    hidden, experts, inter = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    b.replicated(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (experts, hidden), gate_dtype)
    if correction_bias:
        bias = f"{p}.mlp.gate.e_score_correction_bias"
        b.replicated(bias, bias, (experts,), FP32)
    shared = get(c, "n_shared_experts", 0)
    if shared:
        b.mlp(f"{p}.mlp.shared_experts", f"{p}.mlp.shared_experts", inter * shared, hidden)
    b.experts(f"{p}.mlp.experts", f"{p}.mlp.experts", experts, inter, hidden)


class DeepseekV3(Family):
    name = "deepseek_v3"
    model_types = ("deepseek_v3", "kimi_k2")

    megatron_settings = (("multi_latent_attention", True),)
    megatron_names = {
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    }

    def hf_refusal(self, config: Any) -> str:
        if getattr(config, "rope_interleave", True) is False:
            return (
                "rope_interleave=False is not supported by format 'hf': the rope rows of q_b_proj and "
                "kv_a_proj_with_mqa then rotate in halves, where Megatron and vLLM rotate pairs"
            )
        return ""

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        hidden, heads, a = c.hidden_size, c.num_attention_heads, f"{p}.self_attn"
        q_rank, kv_rank = get(c, "q_lora_rank"), c.kv_lora_rank
        nope, rope, value = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        b.divided("num_attention_heads", heads)
        if q_rank:
            b.replicated_rows(
                f"{a}.fused_qkv_a_proj",
                [(f"{a}.q_a_proj", q_rank), (f"{a}.kv_a_proj_with_mqa", kv_rank + rope)],
                hidden,
            )
            b.norm(f"{a}.q_a_layernorm", q_rank)
            b.column(f"{a}.q_b_proj", [(f"{a}.q_b_proj", heads * (nope + rope))], q_rank)
        else:
            b.column(f"{a}.q_proj", [(f"{a}.q_proj", heads * (nope + rope))], hidden)
            kv_a = f"{a}.kv_a_proj_with_mqa.weight"
            b.replicated(kv_a, kv_a, (kv_rank + rope, hidden))
        b.norm(f"{a}.kv_a_layernorm", kv_rank)
        b.column(f"{a}.kv_b_proj", [(f"{a}.kv_b_proj", heads * (nope + value))], kv_rank)
        b.row(f"{a}.o_proj", f"{a}.o_proj", hidden, heads * value)

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        if moe_layer(c, n):  # vLLM creates the correction bias for "noaux_tc" routing only
            moe_with_shared_experts(b, c, p, correction_bias=get(c, "topk_method") == "noaux_tc")
        else:
            super().vllm_mlp(b, c, n, p)

    def experts(self, c: Any) -> int:
        return get(c, "n_routed_experts", 0)

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        routing = "noaux_tc" if cfg.expert_bias else None
        return with_sigmoid_moe(super().hf_config(cfg), cfg, topk_method=routing, **vars(cfg.mla))


def with_sigmoid_moe(config: SimpleNamespace, cfg: Any, **fields: Any) -> SimpleNamespace:
    """``config`` with DeepSeek-V3's MoE fields (also GLM-4.5's) from a catalogue ``GPTConfig``."""
    shared = cfg.shared_expert_ffn // cfg.moe_ffn if cfg.moe_ffn else 0
    return SimpleNamespace(**vars(config), n_routed_experts=cfg.experts, n_shared_experts=shared,
                           first_k_dense_replace=cfg.first_dense_layers, **fields)  # fmt: skip


FAMILY = DeepseekV3()
