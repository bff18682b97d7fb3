"""An independent converter to vLLM's per-rank parameters, straight from docs/formats.md (no reshard code).

``expected_vllm(full, config, groups, rank, ...)`` takes the full HF tensors as transformers holds them
in memory (fused experts ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) and
returns what vLLM holds on ``rank`` (padding rows zero) plus the number of padding elements.
"""

from __future__ import annotations

import torch


def hf_values(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fill every parameter of ``model`` with telling values (global index and name); return copies."""
    from reshard_core.testing.models import coord_values, salt

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(coord_values(p.shape, seed, p.dtype) + salt(name))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def expected_vllm(
    full: dict[str, torch.Tensor],
    config,
    groups: list[tuple[int, ...]],
    rank: int,
    *,
    ep: bool = False,
    placement: str = "linear",
) -> tuple[dict[str, torch.Tensor], int]:
    """vLLM's parameters on ``rank`` (TP groups ``groups`` in DP order) and its padding element count."""
    flat = [r for g in groups for r in g]
    tp, f = len(groups[0]), flat.index(rank)
    d = f % tp
    vocab, hidden = config.vocab_size, config.hidden_size
    nh, ng, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out: dict[str, torch.Tensor] = {}
    padding = 0

    def vocab_rows(w: torch.Tensor) -> torch.Tensor:
        nonlocal padding
        per = -(-vocab // 64) * 64 // tp
        n = max(0, min(vocab - d * per, per))
        rows = torch.zeros(per, hidden, dtype=w.dtype)
        rows[:n] = w[d * per : d * per + n]
        padding += (per - n) * hidden
        return rows

    out["model.embed_tokens.weight"] = vocab_rows(full["model.embed_tokens.weight"])
    qd = nh // tp
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        q = full[p + "self_attn.q_proj.weight"][d * qd * h : (d + 1) * qd * h]
        if tp <= ng:
            gd = ng // tp
            kv_rows = slice(d * gd * h, (d + 1) * gd * h)
        else:
            g = d // (tp // ng)
            kv_rows = slice(g * h, (g + 1) * h)
        k, v = full[p + "self_attn.k_proj.weight"][kv_rows], full[p + "self_attn.v_proj.weight"][kv_rows]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        heads = slice(d * qd * h, (d + 1) * qd * h)
        out[p + "self_attn.o_proj.weight"] = full[p + "self_attn.o_proj.weight"][:, heads]
        for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if p + norm in full:
                out[p + norm] = full[p + norm]
        if p + "mlp.experts.gate_up_proj" in full:
            gate_up, down = full[p + "mlp.experts.gate_up_proj"], full[p + "mlp.experts.down_proj"]
            experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
            out[p + "mlp.gate.weight"] = full[p + "mlp.gate.weight"]
            if ep:
                size = len(flat)
                if placement == "linear":
                    b, rem = divmod(experts, size)
                    mine = range(f * b + min(f, rem), f * b + min(f, rem) + b + (f < rem))
                else:
                    mine = range(f, experts, size)
                out[p + "mlp.experts.w13_weight"] = torch.stack([gate_up[e] for e in mine])
                out[p + "mlp.experts.w2_weight"] = torch.stack([down[e] for e in mine])
            else:
                il = inter // len(flat)
                rows = slice(f * il, (f + 1) * il)
                out[p + "mlp.experts.w13_weight"] = torch.stack(
                    [torch.cat([gate_up[e, :inter][rows], gate_up[e, inter:][rows]]) for e in range(experts)]
                )
                out[p + "mlp.experts.w2_weight"] = torch.stack([down[e][:, rows] for e in range(experts)])
        else:
            inter = full[p + "mlp.gate_proj.weight"].shape[0]
            il = inter // tp
            rows = slice(d * il, (d + 1) * il)
            gate, up = full[p + "mlp.gate_proj.weight"][rows], full[p + "mlp.up_proj.weight"][rows]
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
            out[p + "mlp.down_proj.weight"] = full[p + "mlp.down_proj.weight"][:, rows]
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = full[p + norm]
    out["model.norm.weight"] = full["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = vocab_rows(full["lm_head.weight"])
    return out, padding
