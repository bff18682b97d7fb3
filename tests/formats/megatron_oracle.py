"""An independent converter from HF tensors to a Megatron-Core GPTModel's parameters (no reshard code).

``expected_megatron(model, full, ...)`` gives, for every parameter of a real Megatron model on this
rank (stage-local names), the tensor it must hold when the logical (HF) tensors are ``full``, straight
from formats.md: group-major ``linear_qkv``, ``[gate_s; up_s]`` fc1, row-parallel ``linear_proj`` /
``linear_fc2``, vocab rows past V filled with ``pad``. Global layer numbers, global expert indices
and TP ranks come from Megatron's own attributes (``layer_number``, ``local_expert_indices``,
``pg_collection``). ``full`` holds transformers 5's in-memory tensors (MoE experts fused
``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``).
"""

from __future__ import annotations

import zlib

import torch


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
) -> dict[str, torch.Tensor]:
    """What each parameter of ``model`` (a GPTModel on this rank) holds when converted from ``full``."""
    pgs = model.pg_collection
    tp, s = pgs.tp.size(), pgs.tp.rank()
    etp, es = pgs.expt_tp.size(), pgs.expt_tp.rank()
    out = {}
    for name, _ in model.named_parameters():
        out[name] = _piece(
            model, name, full, heads, groups, head_dim, padded_vocab, tied, pad, (tp, s), (etp, es)
        )
    return out


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
    if what == "self_attention.linear_qkv.weight":
        p, gs = nh // ng, ng // tp
        q, key, v = (full[hf + f"self_attn.{x}_proj.weight"] for x in "qkv")
        blocks = []
        for g in range(s * gs, (s + 1) * gs):  # group g: its p query heads, then k_g, then v_g
            blocks += [q[g * p * h : (g + 1) * p * h], key[g * h : (g + 1) * h], v[g * h : (g + 1) * h]]
        return torch.cat(blocks)
    if what == "mlp.linear_fc1.weight":
        return torch.cat([rows(full[hf + "mlp.gate_proj.weight"]), rows(full[hf + "mlp.up_proj.weight"])])
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
        "mlp.linear_fc2.weight": (cols, "mlp.down_proj.weight"),
        "input_layernorm.weight": (None, "input_layernorm.weight"),
        "pre_mlp_layernorm.weight": (None, "post_attention_layernorm.weight"),
        "self_attention.q_layernorm.weight": (None, "self_attn.q_norm.weight"),
        "self_attention.k_layernorm.weight": (None, "self_attn.k_norm.weight"),
        "mlp.router.weight": (None, "mlp.gate.weight"),
    }
    cut, key = simple[what]
    return cut(full[hf + key]) if cut else full[hf + key]
