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

Megatron-Core (``experimental_attention_variant="gated_delta_net"``, which picks this family, with
``attention_output_gate`` and zero-centred norms, as Megatron-Bridge builds it), TP size ``T``:

=====================================================  ==========================================
Megatron ``decoder.layers.L.self_attention.``           logical ``model.layers.L.``
=====================================================  ==========================================
``in_proj.weight``: rank r's ``[Q_r; K_r; V_r; Z_r;      ``linear_attn.in_proj_qkvz`` / ``in_proj_ba``:
B_r; A_r]`` (each part split over TP)                   rank r's key heads' groups, reassembled
``in_proj.layer_norm_weight`` (TE)                      ``input_layernorm.weight``
``conv1d.weight`` ``[Q_r | K_r | V_r]`` channels        ``linear_attn.conv1d.weight`` (components)
``dt_bias``, ``A_log`` ``[nv/T]``                       ``linear_attn.dt_bias``, ``A_log``
``out_norm.weight`` (``x · (1 + w)``)                   ``linear_attn.norm.weight`` (``x · w``):
                                                        the stored value + 1
``out_proj.weight``                                     ``linear_attn.out_proj.weight``
``linear_qkv`` per group ``[q heads; gates; k; v]``     ``self_attn.q_proj`` (per head: query, gate),
                                                        ``k_proj``, ``v_proj``
=====================================================  ==========================================

The MoE layers are Qwen2-MoE's. The other norms are zero-centred on both sides and move as stored.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ...errors import FormatError
from ...specs import TensorSpec
from ..pieces import assembled, components, ways
from ..vllm_blocks import VLLMBlocks
from .family import FP32, get, head_dim
from .qwen2_moe import Qwen2Moe

_ATTENTION = "self_attention."


class Qwen3Next(Qwen2Moe):
    name = "qwen3_next"
    model_types = ("qwen3_next",)
    megatron_settings = (
        ("experimental_attention_variant", "gated_delta_net"),
        ("attention_output_gate", True),
        ("layernorm_zero_centered_gamma", True),
    )
    megatron_names = Qwen2Moe.megatron_names | {
        "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
        "self_attention.dt_bias": "linear_attn.dt_bias",
        "self_attention.A_log": "linear_attn.A_log",
        "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
    }

    def megatron_matches(self, config: Any) -> bool:
        return getattr(config, "experimental_attention_variant", None) == "gated_delta_net"

    def megatron_refusal(self, config: Any) -> str:
        if not getattr(config, "layernorm_zero_centered_gamma", False):
            return (
                "its norms are zero-centred (HF computes x·(1 + w)); build it with "
                "layernorm_zero_centered_gamma=True, as Megatron-Bridge does"
            )
        if not getattr(config, "attention_output_gate", False):
            return "its full-attention layers gate their output; build it with attention_output_gate=True"
        return ""

    def megatron_moves(
        self, spec: TensorSpec, prefix: str, rest: str, config: Any, rank: int
    ) -> list[TensorSpec] | None:
        a = f"{prefix}linear_attn."
        nk, nv, dk, dv = config.delta_net
        if rest == "self_attention.in_proj.weight":
            return in_proj(spec, a, nk, nv, dk, dv)
        if rest == "self_attention.conv1d.weight":
            return [components(spec, 0, (nk * dk, nk * dk, nv * dv), f"{a}conv1d.weight")]
        if rest == "self_attention.out_norm.weight":
            return [assembled(spec, f"{a}norm.weight", tuple(spec.meta.shape), offset=1.0)]
        return None

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


def in_proj(spec: TensorSpec, a: str, nk: int, nv: int, dk: int, dv: int) -> list[TensorSpec]:
    """Megatron's ``in_proj`` (rank r: ``[Q_r; K_r; V_r; Z_r; B_r; A_r]``, ``nk/T`` key heads) as HF's
    ``in_proj_qkvz`` (per key head ``[q; k; v; z]``) and ``in_proj_ba`` (per key head ``[b; a]``)."""
    rows, hidden = spec.meta.shape
    width = ways(spec, 0)
    if nk % width or nv % nk or rows != 2 * (nk * dk + nv * dv + nv):
        raise FormatError(
            f"{spec.meta.name} has {rows} rows: not [Q; K; V; Z; B; A] of {nk} key heads of {dk} and "
            f"{nv} value heads of {dv} split evenly over TP"
        )
    per, keys, values, heads = nv // nk, nk // width * dk, nv // width * dv, nv // width
    group, v = 2 * dk + 2 * per * dv, per * dv
    qkvz, ba = [], []
    for j in range(nk // width):  # the rank's j-th key head: where its rows sit on either side
        at = j * group
        qkvz += [(at, j * dk, dk), (at + dk, keys + j * dk, dk), (at + 2 * dk, 2 * keys + j * v, v),
                 (at + 2 * dk + v, 2 * keys + values + j * v, v)]  # fmt: skip
        rest = 2 * keys + 2 * values
        ba += [(2 * j * per, rest + j * per, per), (2 * j * per + per, rest + heads + j * per, per)]
    return [
        assembled(spec, f"{a}in_proj_qkvz.weight", (nk * group, hidden), qkvz),
        assembled(spec, f"{a}in_proj_ba.weight", (2 * nv, hidden), ba),
    ]


FAMILY = Qwen3Next()
