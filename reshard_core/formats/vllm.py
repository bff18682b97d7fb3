"""vLLM's (and SGLang's) parameter convention: fused, padded, per-rank parameters without metadata.

An engine in vLLM's convention holds on each rank (vLLM's ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``; TP size ``T``, TP rank ``d``):

- ``model.embed_tokens.weight`` and ``lm_head.weight`` (absent when tied): ``[V_pad/T, H]``,
  ``V_pad = ceil(V/64)·64``; rank d holds padded rows ``[d·V_pad/T, +V_pad/T)``, rows past V are
  padding (zero-filled once on a destination, never sent);
- ``self_attn.qkv_proj.weight`` ``[q_d; k_d; v_d]``: ``nh/T`` query heads, and ``ng/T`` kv heads, or
  when ``T > ng`` one kv head (``d // (T/ng)``) replicated over ``T/ng`` ranks; ``o_proj``
  row-parallel; Qwen3's ``q_norm``/``k_norm`` replicated;
- ``mlp.gate_up_proj.weight`` ``[gate_d; up_d]``, ``down_proj`` row-parallel; norms replicated;
- MoE layers: the router ``mlp.gate.weight`` replicated; ``mlp.experts.w13_weight
  [E_local, 2I/M, H]`` (``[gate; up]`` rows of each local expert) and ``w2_weight [E_local, H, I/M]``.
  Without expert parallelism every rank holds every expert cut over ``M = DP × TP`` ranks (flattened,
  ``dp_rank·T + tp_rank``); with it, ``DP × TP`` ranks hold whole experts, placed "linear" (rank r
  owns ``[r·b + min(r, q), … + b + (r < q))``, ``b = E // P``, ``q = E % P``) or "round_robin".
  Newer vLLM names them ``mlp.experts.routed_experts.*``; both are accepted.

vLLM's layers carry no sharding metadata, so this format derives each logical (HF checkpoint)
tensor's layout from the model's transformers config (``model.config``) and a ``VLLMParallel``
description (``vllm_parallel.py``), and its local piece as a cut of a fused parameter (rows of
``qkv_proj``, ``w13_weight[k, :I_l]``, …: the cut language of ``cuts.py``; this module is only
vLLM's naming, fusion and padding table). The description is the model's ``reshard_vllm_parallel``
attribute, set by ``declare_vllm`` (for a live vLLM worker, ``reshard-vllm`` declares it from vLLM's
own process groups: pipeline parallel size 1, the ranks of vLLM's world).

A custom engine (an SGLang model, a hand-written one) with vLLM's names and per-rank shapes and a
``config`` attribute declares it::

    from reshard_core.formats import VLLMParallel, declare_vllm
    declare_vllm(engine, VLLMParallel.of((0, 1, 2, 3)))
    # = declare_format(engine, "vllm"); engine.reshard_vllm_parallel = VLLMParallel.of((0, 1, 2, 3))

``vllm_logical_specs(config, parallel, rank)`` gives the same logical layouts with no model and no
tensors (``rank=None``: every logical tensor), for an integrator planning offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FormatError
from ..extract import ExtractContext, iter_tensors, strip_wrappers, unwrap
from ..layout import Layout, Placement, Replicate, Shard
from ..specs import TensorSpec
from .base import FormatSpecs, ModelFormat
from .cuts import EngineTable, Narrow, Select
from .registry import declare_format
from .vllm_parallel import PARALLEL_ATTR, VLLMParallel, parallel_of

__all__ = [
    "PARALLEL_ATTR",
    "VOCAB_PADDING",
    "VLLMFormat",
    "VLLMParallel",
    "declare_vllm",
    "vllm_logical_specs",
    "vllm_param_shapes",
]

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocab is padded to a multiple of it, then split over TP."""

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
_ROUTED = ".experts.routed_experts."


@dataclass(frozen=True)
class _Dims:
    """What the convention needs from a transformers config."""

    model_type: str
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int
    experts: int
    moe_inter: int
    moe_layers: frozenset[int]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied: bool

    @classmethod
    def of(cls, config: Any) -> _Dims:
        model_type = getattr(config, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise FormatError(f"format 'vllm' knows model types {', '.join(MODEL_TYPES)}, not {model_type!r}")
        get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
        heads, layers = get("num_attention_heads"), get("num_hidden_layers")
        experts = (get("num_experts") or 0) if model_type == "qwen3_moe" else 0
        step, dense = get("decoder_sparse_step", 1) or 1, set(get("mlp_only_layers") or ())
        moe = frozenset(n for n in range(layers) if experts and n not in dense and (n + 1) % step == 0)
        attention_bias = bool(get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab=get("vocab_size"),
            hidden=get("hidden_size"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            inter=get("intermediate_size"),
            layers=layers,
            experts=experts,
            moe_inter=get("moe_intermediate_size") or 0,
            moe_layers=moe,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "mistral") and attention_bias,
            mlp_bias=model_type in ("llama", "mistral") and bool(get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tied=bool(get("tie_word_embeddings", False)),
        )


class _Builder:
    """vLLM's naming, fusion and padding table for one rank (or none) of one config and arrangement."""

    def __init__(self, dims: _Dims, par: VLLMParallel, rank: int | None) -> None:
        self.c, self.par = dims, par
        if rank is not None and rank not in par.ranks:
            raise FormatError(f"format 'vllm': rank {rank} is not in the parallel description {par}")
        self.flat = par.ranks.index(rank) if rank is not None else None  # this rank's index in par.ranks
        self.t = EngineTable("vllm", rank, "the config and parallel description")

    # ------------------------------------------------------------------ vLLM's layouts

    def dense(self, placement: Placement) -> Layout:
        """``placement`` over the TP group, replicated over DP replicas."""
        par = self.par
        if par.dp_size == 1:
            return self.t.layout(par.tp_groups[0], (par.tp_size,), placement)
        return self.t.layout(par.ranks, (par.dp_size, par.tp_size), Replicate(), placement)

    def kv_replicated(self, groups: int) -> Layout:
        """kv heads over ``groups`` blocks of ``T/groups`` consecutive TP ranks holding one head each."""
        par = self.par
        r = par.tp_size // groups
        if par.dp_size == 1:
            return self.t.layout(par.tp_groups[0], (groups, r), Shard(0), Replicate())
        return self.t.layout(par.ranks, (par.dp_size, groups, r), Replicate(), Shard(0), Replicate())

    def flat_layout(self, placement: Placement) -> Layout:
        """``placement`` over every rank flattened (vLLM's MoE tensor parallelism, ``M = DP × TP``)."""
        return self.t.layout(self.par.ranks, (len(self.par.ranks),), placement)

    def whole(self, name: str, shape: tuple[int, ...]) -> None:
        """A replicated parameter that is its own logical tensor."""
        self.t.whole(name, shape, self.flat_layout(Replicate()))

    # ------------------------------------------------------------------ the model

    def build(self) -> EngineTable:
        c = self.c
        self.vocab("model.embed_tokens.weight")
        for n in range(c.layers):
            p = f"model.layers.{n}"
            self.attention(f"{p}.self_attn")
            if n in c.moe_layers:
                self.moe(f"{p}.mlp")
            else:
                self.mlp(f"{p}.mlp", c.inter)
            self.whole(f"{p}.input_layernorm.weight", (c.hidden,))
            self.whole(f"{p}.post_attention_layernorm.weight", (c.hidden,))
        self.whole("model.norm.weight", (c.hidden,))
        if not c.tied:
            self.vocab("lm_head.weight")
        return self.t

    def vocab(self, name: str) -> None:
        c = self.c
        padded = -(-c.vocab // VOCAB_PADDING) * VOCAB_PADDING
        self.t.param(name, (self.t.divided("the padded vocab", padded, self.par.tp_size), c.hidden))
        self.t.unpadded(name, (padded, c.hidden), self.dense(Shard(0)), 0, c.vocab)

    def attention(self, p: str) -> None:
        c, t = self.c, self.par.tp_size
        h = c.head_dim
        q = self.t.divided("num_attention_heads", c.heads, t)
        if t <= c.kv_heads:
            kv, kv_layout = self.t.divided("num_key_value_heads", c.kv_heads, t), self.dense(Shard(0))
        else:
            self.t.divided("the TP size", t, c.kv_heads, "num_key_value_heads")
            kv, kv_layout = 1, self.kv_replicated(c.kv_heads)
        rows = {"q_proj": (0, q * h), "k_proj": (q * h, kv * h), "v_proj": ((q + kv) * h, kv * h)}
        full = {"q_proj": c.heads * h, "k_proj": c.kv_heads * h, "v_proj": c.kv_heads * h}
        layouts = {"q_proj": self.dense(Shard(0)), "k_proj": kv_layout, "v_proj": kv_layout}
        for kind, cols in (("weight", (c.hidden,)), ("bias", ())):
            if kind == "bias" and not c.qkv_bias:
                continue
            param = f"{p}.qkv_proj.{kind}"
            self.t.param(param, ((q + 2 * kv) * h, *cols))
            for part, (start, n) in rows.items():
                self.t.piece(
                    f"{p}.{part}.{kind}", (full[part], *cols), layouts[part], param, (Narrow(0, start, n),)
                )
        o_proj = f"{p}.o_proj.weight"
        self.t.param(o_proj, (c.hidden, q * h))
        self.t.piece(o_proj, (c.hidden, c.heads * h), self.dense(Shard(1)), o_proj)
        if c.o_bias:
            self.whole(f"{p}.o_proj.bias", (c.hidden,))
        if c.qk_norm:
            self.whole(f"{p}.q_norm.weight", (h,))
            self.whole(f"{p}.k_norm.weight", (h,))

    def mlp(self, p: str, inter: int) -> None:
        c = self.c
        il = self.t.divided("intermediate_size", inter, self.par.tp_size)
        for kind, cols in (("weight", (c.hidden,)), ("bias", ())):
            if kind == "bias" and not c.mlp_bias:
                continue
            param = f"{p}.gate_up_proj.{kind}"
            self.t.param(param, (2 * il, *cols))
            for part, start in (("gate_proj", 0), ("up_proj", il)):
                self.t.piece(
                    f"{p}.{part}.{kind}", (inter, *cols), self.dense(Shard(0)), param, (Narrow(0, start, il),)
                )
        down = f"{p}.down_proj.weight"
        self.t.param(down, (c.hidden, il))
        self.t.piece(down, (c.hidden, inter), self.dense(Shard(1)), down)
        if c.mlp_bias:
            self.whole(f"{p}.down_proj.bias", (c.hidden,))

    def moe(self, p: str) -> None:
        c, par = self.c, self.par
        self.whole(f"{p}.gate.weight", (c.experts, c.hidden))
        w13, w2 = f"{p}.experts.w13_weight", f"{p}.experts.w2_weight"
        if par.use_ep:
            owned = par.experts_of(c.experts)
            if self.flat is not None:
                self.t.param(w13, (len(owned[self.flat]), 2 * c.moe_inter, c.hidden))
                self.t.param(w2, (len(owned[self.flat]), c.hidden, c.moe_inter))
            for j, experts in enumerate(owned):
                whole = self.t.layout((par.ranks[j],), (1,), Replicate())  # the expert's one owner
                for k, e in enumerate(experts):
                    self.expert(p, e, whole, whole, Select(0, k), c.moe_inter)
            return
        il = self.t.divided("moe_intermediate_size", c.moe_inter, len(par.ranks), "DP × TP")
        self.t.param(w13, (c.experts, 2 * il, c.hidden))
        self.t.param(w2, (c.experts, c.hidden, il))
        rows, cols = self.flat_layout(Shard(0)), self.flat_layout(Shard(1))
        for e in range(c.experts):
            self.expert(p, e, rows, cols, Select(0, e), il)

    def expert(self, p: str, e: int, rows: Layout, cols: Layout, pick: Select, il: int) -> None:
        """Expert ``e``'s gate/up (``rows`` layout) and down (``cols``) from ``pick`` of w13/w2."""
        w13, w2, name = f"{p}.experts.w13_weight", f"{p}.experts.w2_weight", f"{p}.experts.{e}"
        gate, down = (self.c.moe_inter, self.c.hidden), (self.c.hidden, self.c.moe_inter)
        self.t.piece(f"{name}.gate_proj.weight", gate, rows, w13, (pick, Narrow(0, 0, il)))
        self.t.piece(f"{name}.up_proj.weight", gate, rows, w13, (pick, Narrow(0, il, il)))
        self.t.piece(f"{name}.down_proj.weight", down, cols, w2, (pick,))


def _table(config: Any, parallel: VLLMParallel, rank: int | None) -> EngineTable:
    return _Builder(_Dims.of(config), parallel, rank).build()


def vllm_logical_specs(
    config: Any, parallel: VLLMParallel, rank: int | None = None, dtype: torch.dtype | None = None
) -> list[TensorSpec]:
    """The logical tensors (HF checkpoint names) of a vLLM engine with ``config`` laid out as
    ``parallel``, as specs without tensors: every one when ``rank`` is None, else those ``rank`` holds.

    ``dtype`` defaults to the config's ``dtype``, else bfloat16. Raises
    ``FormatError`` for a model type or a size the convention cannot split.
    """
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    return _table(config, parallel, rank).specs(dtype)


def vllm_param_shapes(config: Any, parallel: VLLMParallel, rank: int) -> dict[str, tuple[int, ...]]:
    """vLLM's parameter names on ``rank`` and their local shapes under this convention."""
    return dict(_table(config, parallel, rank).params)


def declare_vllm(model: Any, parallel: VLLMParallel) -> Any:
    """Declare ``model`` (an engine with vLLM's names and shapes and a ``config``) in format "vllm"
    laid out as ``parallel``; return it."""
    setattr(unwrap(model), PARALLEL_ATTR, parallel)
    return declare_format(model, "vllm")


class VLLMFormat(ModelFormat):
    """vLLM's per-rank fused, padded parameters; layouts from the config and a ``VLLMParallel``."""

    name = "vllm"
    description = "vLLM/SGLang engines: fused qkv/gate_up/w13, padded vocab; layouts from config + parallel"

    def detect(self, model: Any) -> bool:
        return any(c.__module__.startswith("vllm.") for c in type(model).__mro__)

    def logical_specs(self, model: Any, side: str, context: ExtractContext) -> FormatSpecs:
        """Views of this rank's parameters as logical tensors, and the vocab padding rows.

        Raises ``FormatError`` naming every parameter the config and parallel description imply
        that the model lacks or holds with another local shape. Parameters and floating-point
        buffers the convention does not know are returned as ``unmapped``; integer buffers (vLLM's
        expert maps) and attention layers' kv-cache scales are no weights and are left alone.
        """
        model = _one_model(model)
        return self.resolve(model, dict(weights_of(model)), context.rank)

    def resolve(self, model: Any, weights: dict[str, torch.Tensor], rank: int | None) -> FormatSpecs:
        """``logical_specs`` of ``model`` (its config and parallel description) over ``weights``
        (qualname → tensor: the live ones, or meta tensors of the checkpoint layout, which an
        engine checks before any update)."""
        table = _table(getattr(model, "config", None), parallel_of(model), rank)
        params = {}
        for qualname, tensor in weights.items():
            if not isinstance(tensor, torch.nn.Parameter) and not tensor.is_floating_point():
                continue  # an index buffer (FusedMoE's expert map), not a weight
            if _is_runtime_scale(qualname):
                continue  # an attention layer's kv-cache scales (1.0 unless quantized): no weight
            name = strip_wrappers(qualname)
            params[name.replace(_ROUTED, ".experts.") if _ROUTED in name else name] = (qualname, tensor)
        return table.resolve(params)


def weights_of(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``(qualname, tensor)`` of every parameter and persistent buffer of ``model``."""
    return [(qualname, tensor) for qualname, tensor, _ in iter_tensors(model)]


def _one_model(model: Any) -> Any:
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise FormatError(f"format 'vllm': expected one model, got {len(model)} pipeline chunks")
        model = model[0]
    return unwrap(model)


def _is_runtime_scale(qualname: str) -> bool:
    """vLLM's ``Attention`` layers hold ``_k_scale``, ``_v_scale``, ``_q_scale``, ``_prob_scale``
    as parameters; they scale a quantized kv cache, are no checkpoint weights and never refit."""
    owner, _, last = qualname.rpartition(".")
    return owner.endswith(".attn") and last.startswith("_") and last.endswith("_scale")
