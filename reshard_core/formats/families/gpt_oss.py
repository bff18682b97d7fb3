"""GPT-OSS 20B / 120B (``gpt_oss``): GQA attention with biases and learned per-head sinks, sliding
windows on alternate layers (no weight), and MoE layers whose router has a bias and whose experts
have biases and a clamped SwiGLU on interleaved gate/up columns.

==========================================  ===============================  ==========================
Megatron ``decoder.layers.L.``              logical ``model.layers.L.``      vLLM
==========================================  ===============================  ==========================
``self_attention.linear_qkv.{w,b}``         ``self_attn.{q,k,v}_proj.*``     ``attn.qkv_proj``
``self_attention.linear_proj.{w,b}``        ``self_attn.o_proj.*``           ``attn.o_proj`` (bias whole)
``self_attention.core_attention.            ``self_attn.sinks`` [N]          ``attn.sinks`` [N/T]
softmax_offset`` [N/TP]
``mlp.router.{weight,bias}``                ``mlp.router.*``                 ``mlp.router`` (replicated)
``mlp.experts.local_experts.e.linear_fc1``  ``mlp.experts.e.{gate,up}_proj``  ``w13_weight[e]``, ``w13_bias``
(``[gate; up]``, weight and bias)           (weight, bias)                   rows ``0::2`` / ``1::2``
``...linear_fc2.{w,b}``                     ``mlp.experts.e.down_proj.*``    ``w2_weight[e]``; ``w2_bias[e]``
                                                                             on the first rank, zero
                                                                             on the others
``embedding.word_embeddings.weight``        ``model.embed_tokens.weight``    ``model.embedding.weight``
==========================================  ===============================  ==========================

transformers holds the experts input-major with gate and up interleaved: ``gate_up_proj [E, H, 2I]``
(gate = even columns), ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]``, ``down_proj_bias
[E, H]``; the logical experts are their strided, transposed views. Megatron: ``softmax_type=
"learnable"`` (which picks this family), ``quick_gelu`` with ``glu_linear_offset=1.0`` and
``activation_func_clamp_value=7.0`` (HF's ``swiglu_limit``), ``add_bias_linear``, expert TP 1,
``window_size=(W - 1, 0)`` with ``window_attn_skip_freq=2`` for HF's ``sliding_window=W``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ...specs import TensorSpec
from ..pieces import every, permute, rename, select
from ..vllm_blocks import VLLMBlocks
from .family import Family, get, head_dim

_FUSED = {  # transformers' name → (logical projection names, is a weight)
    ".experts.gate_up_proj": (("gate_proj", "up_proj"), True),
    ".experts.gate_up_proj_bias": (("gate_proj", "up_proj"), False),
    ".experts.down_proj": (("down_proj",), True),
    ".experts.down_proj_bias": (("down_proj",), False),
}


class GptOss(Family):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    vllm_embedding = "model.embedding"

    megatron_settings = (("softmax_type", "learnable"),)
    megatron_names = {
        "self_attention.core_attention.softmax_offset": "self_attn.sinks",
        "mlp.router.weight": "mlp.router.weight",
        "mlp.router.bias": "mlp.router.bias",
    }
    megatron_activations = ("quick_gelu",)

    def experts(self, c: Any) -> int:
        return get(c, "num_local_experts", 0)

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        fields = vars(super().hf_config(cfg)) | {
            "num_local_experts": cfg.experts,
            "intermediate_size": cfg.moe_ffn,
        }
        return SimpleNamespace(**fields)

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        h, heads, kv = head_dim(c), c.num_attention_heads, c.num_key_value_heads
        a, logical = f"{p}.attn", f"{p}.self_attn"
        b.qkv(f"{a}.qkv_proj", logical, heads, kv, h, c.hidden_size, bias=True)
        b.row(f"{a}.o_proj", f"{logical}.o_proj", c.hidden_size, heads * h, bias=True)
        b.heads(f"{a}.sinks", f"{logical}.sinks", heads)

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        experts, hidden = c.num_local_experts, c.hidden_size
        b.replicated(f"{p}.mlp.router.weight", f"{p}.mlp.router.weight", (experts, hidden))
        b.replicated(f"{p}.mlp.router.bias", f"{p}.mlp.router.bias", (experts,))
        b.experts(f"{p}.mlp.experts", f"{p}.mlp.experts", experts, c.intermediate_size, hidden,
                  bias=True, interleaved=True)  # fmt: skip

    def hf_moves(self, spec: TensorSpec, rank: int) -> list[TensorSpec] | None:
        """transformers' fused, input-major experts as per-expert logical tensors (views)."""
        name = spec.meta.name
        suffix = next((s for s in _FUSED if name.endswith(s)), None)
        if suffix is None:
            return None
        parts, weight = _FUSED[suffix]
        prefix, kind = name[: -len(suffix)] + ".experts.", "weight" if weight else "bias"
        out = []
        for e in range(spec.meta.shape[0]):
            expert = select(spec, 0, e, f"{prefix}{e}", rank)
            if expert is None:
                continue
            last = len(expert.meta.shape) - 1
            for i, part in enumerate(parts):
                logical = f"{prefix}{e}.{part}.{kind}"
                piece = every(expert, last, i, len(parts), logical) if len(parts) > 1 else expert
                out.append(permute(piece, (1, 0), logical) if weight else rename(piece, logical))
        return out


FAMILY = GptOss()
