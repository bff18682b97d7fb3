"""An independent converter from HF tensors to a Megatron-Core GPTModel's parameters (no reshard code).

``expected_megatron(model, full, ...)`` gives, for every parameter of a real Megatron model on this
rank (stage-local names), the tensor it must hold when the logical (HF) tensors are ``full``, straight
from docs/formats.md: group-major ``linear_qkv`` (weight and bias) cut into TP equal row ranges (whole
groups when TP ≤ ng; part of one group's ``(p+2)·h`` block when TP > ng, as Megatron 0.16.1 allows),
``[gate_s; up_s]`` fc1, row-parallel ``linear_proj`` / ``linear_fc2``, vocab rows past V filled with
``pad``. Global layer numbers, global expert indices and TP ranks come from Megatron's own
attributes (``layer_number``, ``local_expert_indices``, ``pg_collection``), so virtual pipeline
chunks need nothing more. ``full`` holds transformers 5's in-memory tensors (MoE experts fused
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``).

``rotary_interleaved=True``: Megatron rotates adjacent pairs ``(x_2j, x_2j+1)`` with frequency j
(``rope_utils._rotate_half``), HF Llama rotates ``(x_j, x_j+h/2)``; so within every q and k head
Megatron row ``2j`` is HF row ``j`` and row ``2j+1`` is HF row ``h/2 + j``; q/k norm weights (over
the head dim) are permuted alike, v rows are not.

Shared experts: ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` (split like the dense fc1 / fc2
over TP) and the gate ``mlp.shared_experts.gate_weight [1, H]`` (replicated) come from Qwen2-MoE's
``mlp.shared_expert.{gate,up,down}_proj`` / ``mlp.shared_expert_gate.weight`` when ``full`` has
those names, else from DeepSeek-V3's ``mlp.shared_experts.{gate,up,down}_proj``.
"""

from __future__ import annotations

import re
import zlib

import torch

_ROTATED = re.compile(r"self_attn\.([qk]_proj\.(weight|bias)|[qk]_norm\.weight)$")


def hf_values(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fill ``model`` with small distinct values (norm weights near 1) so a forward stays well
    conditioned; return copies of them by name."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 100003 + zlib.crc32(name.encode()))
            values = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.1 * values if name.endswith("norm.weight") else 0.1 * values)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def expected_megatron(
    model,
    full: dict[str, torch.Tensor],
    *,
    heads: int,
    groups: int,
    head_dim: int,
    padded_vocab: int,
    tied: bool,
    pad: float = 0.0,
    rotary_interleaved: bool = False,
) -> dict[str, torch.Tensor]:
    """What each parameter of ``model`` (a GPTModel on this rank) holds when converted from ``full``."""
    pgs = model.pg_collection
    tp, s = pgs.tp.size(), pgs.tp.rank()
    etp, es = pgs.expt_tp.size(), pgs.expt_tp.rank()
    if rotary_interleaved:
        full = {k: interleave_rope_rows(v, head_dim) if _ROTATED.search(k) else v for k, v in full.items()}
    out = {}
    for name, _ in model.named_parameters():
        out[name] = _piece(
            model, name, full, heads, groups, head_dim, padded_vocab, tied, pad, (tp, s), (etp, es)
        )
    return out


def interleave_rope_rows(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF (half-split RoPE) q or k rows → Megatron ``rotary_interleaved`` rows: within each head,
    row ``2j`` ← HF row ``j`` and row ``2j+1`` ← HF row ``head_dim/2 + j``."""
    heads = t.shape[0] // head_dim
    return t.reshape(heads, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _piece(model, name, full, nh, ng, h, padded, tied, pad, tp_at, etp_at):
    tp, s = tp_at
    rows = lambda t, w=tp, i=s: t.chunk(w)[i]  # noqa: E731
    cols = lambda t, w=tp, i=s: t.chunk(w, dim=1)[i]  # noqa: E731
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        key = "lm_head.weight" if name == "output_layer.weight" and not tied else "model.embed_tokens.weight"
        real = full[key]
        extra = torch.full((padded - real.shape[0], real.shape[1]), pad, dtype=real.dtype)
        return rows(torch.cat([real, extra]))
    if name == "decoder.final_layernorm.weight":
        return full["model.norm.weight"]
    _, _, k, *rest = name.split(".")
    layer = model.decoder.layers[int(k)]
    hf, what = f"model.layers.{layer.layer_number - 1}.", ".".join(rest)
    if what in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        p, kind = nh // ng, what.rsplit(".", 1)[1]
        q, key, v = (full[hf + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
        blocks = []
        for g in range(ng):  # group g: its p query heads, then k_g, then v_g
            blocks += [q[g * p * h : (g + 1) * p * h], key[g * h : (g + 1) * h], v[g * h : (g + 1) * h]]
        return rows(torch.cat(blocks))  # TP rank s: rows [s·R/TP, (s+1)·R/TP) of all R rows
    if what == "mlp.shared_experts.gate_weight":
        return full[hf + "mlp.shared_expert_gate.weight"]
    ffn = "mlp."
    if what.startswith("mlp.shared_experts.linear_fc"):  # Qwen2-MoE's names when full has them
        qwen2 = hf + "mlp.shared_expert.gate_proj.weight" in full
        ffn = "mlp.shared_expert." if qwen2 else "mlp.shared_experts."
        what = "mlp." + what.removeprefix("mlp.shared_experts.")
    if what in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = what.rsplit(".", 1)[1]
        return torch.cat(
            [rows(full[hf + ffn + f"gate_proj.{kind}"]), rows(full[hf + ffn + f"up_proj.{kind}"])]
        )
    if what == "mlp.linear_fc2.weight":
        return cols(full[hf + ffn + "down_proj.weight"])
    if what == "mlp.linear_fc2.bias":  # row-parallel: added once after the reduction, whole on every rank
        return full[hf + ffn + "down_proj.bias"]
    if what.startswith("mlp.experts.local_experts."):
        _, _, _, j, fc, _ = what.split(".")
        e = layer.mlp.local_expert_indices[int(j)]
        etp, es = etp_at
        if fc == "linear_fc1":
            fused = full[hf + "mlp.experts.gate_up_proj"][e]
            inter = fused.shape[0] // 2
            return torch.cat([fused[:inter].chunk(etp)[es], fused[inter:].chunk(etp)[es]])
        return full[hf + "mlp.experts.down_proj"][e].chunk(etp, dim=1)[es]
    simple = {
        "self_attention.linear_proj.weight": (cols, "self_attn.o_proj.weight"),
        "self_attention.linear_proj.bias": (None, "self_attn.o_proj.bias"),
        "input_layernorm.weight": (None, "input_layernorm.weight"),
        "pre_mlp_layernorm.weight": (None, "post_attention_layernorm.weight"),
        "self_attention.q_layernorm.weight": (None, "self_attn.q_norm.weight"),
        "self_attention.k_layernorm.weight": (None, "self_attn.k_norm.weight"),
        "mlp.router.weight": (None, "mlp.gate.weight"),
    }
    cut, key = simple[what]
    return cut(full[hf + key]) if cut else full[hf + key]
