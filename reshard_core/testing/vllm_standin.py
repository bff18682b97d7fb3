"""A stand-in for one rank of vLLM's ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

vLLM needs a CUDA torch and cannot be installed here; this stand-in has vLLM's names and per-rank
shapes. It holds no forward pass and no process group: only the parameters vLLM's layers allocate
on one rank, sized the way those layers size them (``VocabParallelEmbedding``/``ParallelLMHead``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``, ``ReplicatedLinear``,
``RMSNorm``, ``FusedMoE`` with ``determine_expert_map``), written from vLLM's rules, not from
``reshard_core.formats.vllm``. A GPU test compares it with real vLLM where vLLM is installed.

Every element starts as ``fill`` (NaN by default), padding rows too, so a test sees anything a
refit left unwritten. The model carries ``config`` (the transformers config it was built from) and
``rank``, and declares itself in format "vllm" with its ``VLLMParallel`` (``declare_vllm``), as any
engine outside vLLM does: the format has no knowledge of this module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..formats import VLLMParallel, declare_vllm

PAD_TO = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _divide(numerator: int, denominator: int) -> int:
    """vLLM's ``divide``: exact division or an error."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


class _Holder(nn.Module):
    """A layer reduced to its parameters."""

    def __init__(self, dtype: torch.dtype, fill: float, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            data = torch.full(shape, fill, dtype=dtype)
            self.register_parameter(name, nn.Parameter(data, requires_grad=False))


class VLLMStandInForCausalLM(nn.Module):
    """One rank of a vLLM engine's dense or MoE causal LM: vLLM's parameter names and local shapes.

    ``config``: a transformers ``LlamaConfig``/``Qwen2Config``/``Qwen3Config``/``Qwen3MoeConfig``.
    ``parallel``: the engine's TP groups (DP order) and MoE options. ``rank``: this process's global
    rank (default: ``torch.distributed``'s, else 0).
    """

    def __init__(
        self,
        config: Any,
        parallel: VLLMParallel,
        rank: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        fill: float = float("nan"),
    ) -> None:
        super().__init__()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        flat = parallel.ranks.index(rank)  # ValueError when the rank is not in the engine
        self.config, self.rank = config, rank
        tp_size = parallel.tp_size
        moe_tp = len(parallel.ranks)  # FusedMoE's tp_size: DP × TP flattened
        kind = config.model_type
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        qkv_bias = kind == "qwen2" or bool(getattr(config, "attention_bias", False))
        llama = kind in ("llama", "mistral")
        hold = lambda **shapes: _Holder(dtype, fill, **shapes)  # noqa: E731

        def vocab() -> nn.Module:
            padded = (config.vocab_size + PAD_TO - 1) // PAD_TO * PAD_TO
            return hold(weight=(_divide(padded, tp_size), hidden))

        def attention() -> nn.Module:
            heads = _divide(config.num_attention_heads, tp_size)
            total_kv = config.num_key_value_heads
            kv = 1 if tp_size >= total_kv else _divide(total_kv, tp_size)
            if tp_size >= total_kv:
                _divide(tp_size, total_kv)  # num_kv_head_replicas
            rows = (heads + 2 * kv) * head_dim
            qkv = hold(weight=(rows, hidden), **({"bias": (rows,)} if qkv_bias else {}))
            o_bias = {"bias": (hidden,)} if llama and getattr(config, "attention_bias", False) else {}
            out = nn.Module()
            out.qkv_proj, out.o_proj = qkv, hold(weight=(hidden, heads * head_dim), **o_bias)
            if kind in ("qwen3", "qwen3_moe"):
                out.q_norm, out.k_norm = hold(weight=(head_dim,)), hold(weight=(head_dim,))
            return out

        def mlp(intermediate: int) -> nn.Module:
            part = _divide(intermediate, tp_size)
            bias = llama and bool(getattr(config, "mlp_bias", False))
            out = nn.Module()
            out.gate_up_proj = hold(weight=(2 * part, hidden), **({"bias": (2 * part,)} if bias else {}))
            out.down_proj = hold(weight=(hidden, part), **({"bias": (hidden,)} if bias else {}))
            return out

        def moe() -> nn.Module:
            experts, inter = config.num_experts, config.moe_intermediate_size
            if parallel.enable_expert_parallel and moe_tp > 1:  # EP over DP × TP, expert TP 1
                ep_size, ep_rank, part = moe_tp, flat, inter
                base, remainder = divmod(experts, ep_size)
                local = base + 1 if ep_rank < remainder else base
            else:
                local, part = experts, _divide(inter, moe_tp)
            out = nn.Module()
            out.gate = hold(weight=(experts, hidden))
            out.experts = hold(w13_weight=(local, 2 * part, hidden), w2_weight=(local, hidden, part))
            return out

        def is_moe(n: int) -> bool:
            if kind != "qwen3_moe" or not config.num_experts:
                return False
            step = getattr(config, "decoder_sparse_step", 1) or 1
            return n not in (getattr(config, "mlp_only_layers", None) or []) and (n + 1) % step == 0

        self.model = nn.Module()
        self.model.embed_tokens = vocab()
        self.model.layers = nn.ModuleList()
        for n in range(config.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn = attention()
            layer.mlp = moe() if is_moe(n) else mlp(config.intermediate_size)
            layer.input_layernorm = hold(weight=(hidden,))
            layer.post_attention_layernorm = hold(weight=(hidden,))
            self.model.layers.append(layer)
        self.model.norm = hold(weight=(hidden,))
        if not getattr(config, "tie_word_embeddings", False):
            self.lm_head = vocab()
        declare_vllm(self, parallel)
