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
description, and its local piece as a view of a fused parameter (rows of ``qkv_proj``,
``w13_weight[k, :I_l]``, …). The description is the model's ``reshard_vllm_parallel`` attribute
(``reshard_core.testing.vllm_standin`` sets it), else, for a real vLLM model, read from vLLM's own
process groups (``parallel_from_vllm``: pipeline parallel size 1, the ranks of vLLM's world).

A custom engine (an SGLang model, a hand-written one) with vLLM's names and per-rank shapes and a
``config`` attribute declares it::

    from reshard_core.formats.vllm import VLLMParallel, declare_vllm
    declare_vllm(engine, VLLMParallel.of((0, 1, 2, 3)))
    # = declare_format(engine, "vllm"); engine.reshard_vllm_parallel = VLLMParallel.of((0, 1, 2, 3))

``vllm_logical_specs(config, parallel, rank)`` gives the same logical layouts with no model and no
tensors (``rank=None``: every logical tensor), for an integrator planning offline.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FormatError
from ..extract import ExtractContext, iter_tensors, strip_wrappers
from ..layout import Layout, Mesh, Placement, Replicate, Shard
from ..specs import TensorMeta, TensorSpec
from .base import FormatSpecs, ModelFormat
from .pieces import unpad
from .registry import declare_format

PARALLEL_ATTR = "reshard_vllm_parallel"
"""The model attribute holding its ``VLLMParallel``."""

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocab is padded to a multiple of it, then split over TP."""

STANDIN_MODULE = "reshard_core.testing.vllm_standin"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
PLACEMENTS = ("linear", "round_robin")
_ROUTED = ".experts.routed_experts."

Cut = tuple[tuple[Any, ...], ...]
"""Views taken in order of a local parameter: ``("select", dim, index)``, ``("narrow", dim, start, n)``."""


@dataclass(frozen=True)
class VLLMParallel:
    """How a vLLM engine's ranks are arranged: ``tp_groups`` (global ranks, TP order) in DP order.

    One group is a plain TP engine; several are data-parallel replicas (dense weights replicated
    over them, MoE experts cut over all ``DP × TP`` ranks). ``enable_expert_parallel`` and
    ``expert_placement`` ("linear" or "round_robin") are vLLM's options of the same names.
    """

    tp_groups: tuple[tuple[int, ...], ...]
    enable_expert_parallel: bool = False
    expert_placement: str = "linear"

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(r) for r in g) for g in self.tp_groups)
        object.__setattr__(self, "tp_groups", groups)
        if not groups or not groups[0]:
            raise ValueError("VLLMParallel needs at least one non-empty TP group")
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"VLLMParallel: TP groups of different sizes {[len(g) for g in groups]}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"VLLMParallel: a rank appears twice in {groups}")
        if self.expert_placement not in PLACEMENTS:
            raise ValueError(f"VLLMParallel: expert_placement must be one of {PLACEMENTS}")

    @classmethod
    def of(
        cls,
        tp_ranks: Sequence[int],
        *,
        dp_replicas: Sequence[Sequence[int]] = (),
        enable_expert_parallel: bool = False,
        expert_placement: str = "linear",
    ) -> VLLMParallel:
        """One TP group (``tp_ranks``), then the TP groups of further DP replicas."""
        groups = (tuple(tp_ranks), *(tuple(g) for g in dp_replicas))
        return cls(groups, enable_expert_parallel, expert_placement)

    @property
    def tp_size(self) -> int:
        return len(self.tp_groups[0])

    @property
    def dp_size(self) -> int:
        return len(self.tp_groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, flattened ``dp_rank·T + tp_rank`` (vLLM's MoE order)."""
        return tuple(r for g in self.tp_groups for r in g)

    @property
    def use_ep(self) -> bool:
        """vLLM holds whole experts per rank only with expert parallelism over more than one rank."""
        return self.enable_expert_parallel and len(self.ranks) > 1

    def experts_of(self, num_experts: int) -> list[list[int]]:
        """The global experts each flattened rank holds, in local order (expert parallelism only)."""
        p = len(self.ranks)
        if self.expert_placement == "round_robin":
            return [list(range(r, num_experts, p)) for r in range(p)]
        b, q = divmod(num_experts, p)
        return [list(range(r * b + min(r, q), r * b + min(r, q) + b + (r < q))) for r in range(p)]


@dataclass(frozen=True)
class _Piece:
    """One logical tensor: its name, global shape and layout, and where this rank holds it."""

    name: str
    shape: tuple[int, ...]
    layout: Layout
    param: str
    cut: Cut | None  # None: this rank holds none of it (or no rank was given)


@dataclass
class _Table:
    pieces: list[_Piece] = field(default_factory=list)
    padding: list[tuple[str, Cut]] = field(default_factory=list)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """vLLM's parameters and their local shapes on the rank (empty when no rank was given)."""


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
    """Fills a ``_Table`` for one rank (or none) of one config and parallel description."""

    def __init__(self, dims: _Dims, par: VLLMParallel, rank: int | None) -> None:
        self.c, self.par, self.rank = dims, par, rank
        self.table = _Table()
        self.flat: int | None = None  # this rank's index in ``par.ranks``
        if rank is not None:
            if rank not in par.ranks:
                raise FormatError(f"format 'vllm': rank {rank} is not in the parallel description {par}")
            self.flat = par.ranks.index(rank)
        self.layouts: dict[tuple, Layout] = {}  # one object per distinct layout: the exchange interns them

    # ------------------------------------------------------------------ layouts

    def layout(self, ranks: tuple[int, ...], shape: tuple[int, ...], *placements: Placement) -> Layout:
        key = (ranks, shape, placements)
        if key not in self.layouts:
            self.layouts[key] = Layout(Mesh(ranks, shape), placements)
        return self.layouts[key]

    def dense(self, placement: Placement) -> Layout:
        """``placement`` over the TP group, replicated over DP replicas."""
        par = self.par
        if par.dp_size == 1:
            return self.layout(par.tp_groups[0], (par.tp_size,), placement)
        return self.layout(par.ranks, (par.dp_size, par.tp_size), Replicate(), placement)

    def replicated(self) -> Layout:
        return self.layout(self.par.ranks, (len(self.par.ranks),), Replicate())

    def kv_replicated(self, groups: int) -> Layout:
        """kv heads over ``groups`` blocks of ``T/groups`` consecutive TP ranks holding one head each."""
        par = self.par
        r = par.tp_size // groups
        if par.dp_size == 1:
            return self.layout(par.tp_groups[0], (groups, r), Shard(0), Replicate())
        return self.layout(par.ranks, (par.dp_size, groups, r), Replicate(), Shard(0), Replicate())

    def flat_layout(self, placement: Placement) -> Layout:
        """``placement`` over every rank flattened (vLLM's MoE tensor parallelism, ``M = DP × TP``)."""
        return self.layout(self.par.ranks, (len(self.par.ranks),), placement)

    def owner(self, rank: int) -> Layout:
        """A whole tensor on one rank (an expert under expert parallelism)."""
        return self.layout((rank,), (1,), Replicate())

    # ------------------------------------------------------------------ table entries

    def param(self, name: str, shape: tuple[int, ...]) -> None:
        if self.rank is not None:
            self.table.params[name] = shape

    def add(self, name: str, shape: tuple[int, ...], layout: Layout, param: str, cut: Cut) -> None:
        holds = self.rank is not None and layout.mesh.coord_of(self.rank) is not None
        self.table.pieces.append(_Piece(name, shape, layout, param, cut if holds else None))

    def whole(self, name: str, shape: tuple[int, ...]) -> None:
        """A replicated parameter that is its own logical tensor."""
        self.param(name, shape)
        self.add(name, shape, self.replicated(), name, ())

    def divided(self, what: str, n: int, by: int, by_what: str = "the TP size") -> int:
        if n % by:
            raise FormatError(f"format 'vllm': {what} ({n}) is not divisible by {by_what} ({by})")
        return n // by

    # ------------------------------------------------------------------ the model

    def build(self) -> _Table:
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
        return self.table

    def vocab(self, name: str) -> None:
        c, t = self.c, self.par.tp_size
        padded = -(-c.vocab // VOCAB_PADDING) * VOCAB_PADDING
        per = self.divided("the padded vocab", padded, t)
        self.param(name, (per, c.hidden))
        physical = TensorSpec(TensorMeta(name, (padded, c.hidden), torch.float32), self.dense(Shard(0)), None)
        logical, _ = unpad(physical, 0, c.vocab, name, -1)
        keep = 0
        if self.rank is not None:
            keep = logical.layout.local_shape((c.vocab, c.hidden), self.rank)[0]
            if keep < per:
                self.table.padding.append((name, (("narrow", 0, keep, per - keep),)))
        self.add(name, (c.vocab, c.hidden), logical.layout, name, (("narrow", 0, 0, keep),))

    def attention(self, p: str) -> None:
        c, t = self.c, self.par.tp_size
        h = c.head_dim
        q = self.divided("num_attention_heads", c.heads, t)
        if t <= c.kv_heads:
            kv, kv_layout = self.divided("num_key_value_heads", c.kv_heads, t), self.dense(Shard(0))
        else:
            self.divided("the TP size", t, c.kv_heads, "num_key_value_heads")
            kv, kv_layout = 1, self.kv_replicated(c.kv_heads)
        rows = {"q_proj": (0, q * h), "k_proj": (q * h, kv * h), "v_proj": ((q + kv) * h, kv * h)}
        full = {"q_proj": c.heads * h, "k_proj": c.kv_heads * h, "v_proj": c.kv_heads * h}
        layouts = {"q_proj": self.dense(Shard(0)), "k_proj": kv_layout, "v_proj": kv_layout}
        for kind, cols in (("weight", (c.hidden,)), ("bias", ())):
            if kind == "bias" and not c.qkv_bias:
                continue
            param = f"{p}.qkv_proj.{kind}"
            self.param(param, ((q + 2 * kv) * h, *cols))
            for part, (start, n) in rows.items():
                cut = (("narrow", 0, start, n),)
                self.add(f"{p}.{part}.{kind}", (full[part], *cols), layouts[part], param, cut)
        o_proj = f"{p}.o_proj.weight"
        self.param(o_proj, (c.hidden, q * h))
        self.add(o_proj, (c.hidden, c.heads * h), self.dense(Shard(1)), o_proj, ())
        if c.o_bias:
            self.whole(f"{p}.o_proj.bias", (c.hidden,))
        if c.qk_norm:
            self.whole(f"{p}.q_norm.weight", (h,))
            self.whole(f"{p}.k_norm.weight", (h,))

    def mlp(self, p: str, inter: int) -> None:
        c = self.c
        il = self.divided("intermediate_size", inter, self.par.tp_size)
        for kind, cols in (("weight", (c.hidden,)), ("bias", ())):
            if kind == "bias" and not c.mlp_bias:
                continue
            param = f"{p}.gate_up_proj.{kind}"
            self.param(param, (2 * il, *cols))
            for part, start in (("gate_proj", 0), ("up_proj", il)):
                cut = (("narrow", 0, start, il),)
                self.add(f"{p}.{part}.{kind}", (inter, *cols), self.dense(Shard(0)), param, cut)
        down = f"{p}.down_proj.weight"
        self.param(down, (c.hidden, il))
        self.add(down, (c.hidden, inter), self.dense(Shard(1)), down, ())
        if c.mlp_bias:
            self.whole(f"{p}.down_proj.bias", (c.hidden,))

    def moe(self, p: str) -> None:
        c, par = self.c, self.par
        self.whole(f"{p}.gate.weight", (c.experts, c.hidden))
        w13, w2 = f"{p}.experts.w13_weight", f"{p}.experts.w2_weight"
        shapes = (c.moe_inter, c.hidden), (c.hidden, c.moe_inter)  # gate/up, down
        if par.use_ep:
            owned = par.experts_of(c.experts)
            if self.flat is not None:
                self.param(w13, (len(owned[self.flat]), 2 * c.moe_inter, c.hidden))
                self.param(w2, (len(owned[self.flat]), c.hidden, c.moe_inter))
            for j, experts in enumerate(owned):
                layout = self.owner(par.ranks[j])
                for k, e in enumerate(experts):
                    self.expert(p, e, layout, layout, (("select", 0, k),), c.moe_inter, shapes)
            return
        il = self.divided("moe_intermediate_size", c.moe_inter, len(par.ranks), "DP × TP")
        self.param(w13, (c.experts, 2 * il, c.hidden))
        self.param(w2, (c.experts, c.hidden, il))
        rows, cols = self.flat_layout(Shard(0)), self.flat_layout(Shard(1))
        for e in range(c.experts):
            self.expert(p, e, rows, cols, (("select", 0, e),), il, shapes)

    def expert(self, p: str, e: int, rows: Layout, cols: Layout, pick: Cut, il: int, shapes) -> None:
        """Expert ``e``'s gate/up (``rows`` layout) and down (``cols``) from ``pick`` of w13/w2."""
        w13, w2, name = f"{p}.experts.w13_weight", f"{p}.experts.w2_weight", f"{p}.experts.{e}"
        gate_shape, down_shape = shapes
        self.add(f"{name}.gate_proj.weight", gate_shape, rows, w13, (*pick, ("narrow", 0, 0, il)))
        self.add(f"{name}.up_proj.weight", gate_shape, rows, w13, (*pick, ("narrow", 0, il, il)))
        self.add(f"{name}.down_proj.weight", down_shape, cols, w2, pick)


def _table(config: Any, parallel: VLLMParallel, rank: int | None) -> _Table:
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
    table = _table(config, parallel, rank)
    return [
        TensorSpec(TensorMeta(p.name, p.shape, dtype), p.layout, None)
        for p in table.pieces
        if rank is None or p.cut is not None
    ]


def vllm_param_shapes(config: Any, parallel: VLLMParallel, rank: int) -> dict[str, tuple[int, ...]]:
    """vLLM's parameter names on ``rank`` and their local shapes under this convention."""
    return dict(_table(config, parallel, rank).params)


def declare_vllm(model: Any, parallel: VLLMParallel) -> Any:
    """Declare ``model`` (an engine with vLLM's names and shapes and a ``config``) in format "vllm"
    laid out as ``parallel``; return it."""
    setattr(model, PARALLEL_ATTR, parallel)
    return declare_format(model, "vllm")


def parallel_from_vllm(model: Any = None) -> VLLMParallel:
    """The parallel description of a model built inside a vLLM worker, from vLLM's process groups.

    Assumes vLLM's rank grid (TP fastest, then pipeline, then DP) with pipeline size 1, and that
    vLLM's ranks are this process group's ranks. MoE options are read from ``model``'s first
    ``FusedMoE`` layer (``moe_parallel_config.use_ep``, ``expert_placement_strategy``).
    """
    ps = sys.modules.get("vllm.distributed.parallel_state")  # a vLLM worker imported it; never import it
    try:
        if ps is None:
            raise RuntimeError("this process is no vLLM worker")
        pp_size = ps.get_pp_group().world_size
    except Exception as exc:  # not imported, or imported without initialised groups
        raise FormatError(
            f"format 'vllm': the model has no {PARALLEL_ATTR} attribute and vLLM's process groups are not "
            f"available ({exc}); set it to a reshard_core.formats.vllm.VLLMParallel"
        ) from exc
    if pp_size > 1:
        raise FormatError("format 'vllm': pipeline-parallel vLLM engines are not supported")
    tp, dp = ps.get_tp_group(), ps.get_dp_group()
    mine = tuple(int(r) for r in tp.ranks)
    me = mine[tp.rank_in_group]
    groups = tuple(tuple(r - me + int(peer) for r in mine) for peer in dp.ranks)
    use_ep, placement = False, "linear"
    for module in model.modules() if model is not None else ():
        config = getattr(module, "moe_parallel_config", None)
        if config is not None:
            use_ep = bool(getattr(config, "use_ep", False))
            placement = str(getattr(module, "expert_placement_strategy", "linear") or "linear")
            break
    return VLLMParallel(groups, use_ep, placement)


def parallel_of(model: Any) -> VLLMParallel:
    """``model``'s ``reshard_vllm_parallel``, else (a real vLLM model) the one vLLM's groups give."""
    found = getattr(model, PARALLEL_ATTR, None)
    if isinstance(found, VLLMParallel):
        return found
    if found is not None:
        raise FormatError(f"format 'vllm': {PARALLEL_ATTR} is a {type(found).__name__}, not a VLLMParallel")
    return parallel_from_vllm(model)


class VLLMFormat(ModelFormat):
    """vLLM's per-rank fused, padded parameters; layouts from the config and a ``VLLMParallel``."""

    name = "vllm"
    description = "vLLM/SGLang engines: fused qkv/gate_up/w13, padded vocab; layouts from config + parallel"

    def detect(self, model: Any) -> bool:
        modules = {c.__module__ for c in type(model).__mro__}
        return STANDIN_MODULE in modules or any(m.startswith("vllm.") for m in modules)

    def logical_specs(self, model: Any, side: str, context: ExtractContext) -> FormatSpecs:
        """Views of this rank's parameters as logical tensors, and the vocab padding rows.

        Raises ``FormatError`` naming every parameter the config and parallel description imply
        that the model lacks or holds with another local shape. Parameters and floating-point
        buffers the convention does not know are returned as ``unmapped``; integer buffers (vLLM's
        expert maps) and attention layers' kv-cache scales are no weights and are left alone.
        """
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise FormatError(f"format 'vllm': expected one model, got {len(model)} pipeline chunks")
            model = model[0]
        table = _table(getattr(model, "config", None), parallel_of(model), context.rank)
        params = {}
        for qualname, tensor, _ in iter_tensors(model):
            if not isinstance(tensor, torch.nn.Parameter) and not tensor.is_floating_point():
                continue  # an index buffer (FusedMoE's expert map), not a weight
            if _is_runtime_scale(qualname):
                continue  # an attention layer's kv-cache scales (1.0 unless quantized): no weight
            name = strip_wrappers(qualname)
            params[name.replace(_ROUTED, ".experts.") if _ROUTED in name else name] = (qualname, tensor)
        _check_params(table, params, context.rank)
        out = FormatSpecs(unmapped=[q for n, (q, _) in params.items() if n not in table.params])
        for piece in table.pieces:
            if piece.cut is not None:
                tensor = _apply(params[piece.param][1], piece.cut)
                meta = TensorMeta(piece.name, piece.shape, tensor.dtype)
                out.specs.append(TensorSpec(meta, piece.layout, tensor))
        out.padding = [_apply(params[name][1], cut) for name, cut in table.padding]
        return out


def _is_runtime_scale(qualname: str) -> bool:
    """vLLM's ``Attention`` layers hold ``_k_scale``, ``_v_scale``, ``_q_scale``, ``_prob_scale``
    as parameters; they scale a quantized kv cache, are no checkpoint weights and never refit."""
    owner, _, last = qualname.rpartition(".")
    return owner.endswith(".attn") and last.startswith("_") and last.endswith("_scale")


def _check_params(table: _Table, params: dict[str, tuple[str, torch.Tensor]], rank: int) -> None:
    missing = [n for n in table.params if n not in params]
    wrong = [
        f"{n} {tuple(params[n][1].shape)}, expected {shape}"
        for n, shape in table.params.items()
        if n in params and tuple(params[n][1].shape) != shape
    ]
    problems = []
    if missing:
        problems.append(f"{_count(missing, 'parameter')} missing: {', '.join(missing)}")
    if wrong:
        problems.append(f"{_count(wrong, 'parameter')} with another local shape: {'; '.join(wrong)}")
    if problems:
        raise FormatError(
            f"format 'vllm' on rank {rank}: the config and parallel description imply "
            + " and ".join(problems)
        )


def _count(items: list, word: str) -> str:
    return f"{len(items)} {word}{'s' if len(items) != 1 else ''}"


def _apply(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    out = tensor.detach() if isinstance(tensor, torch.nn.Parameter) else tensor
    for op, dim, *args in cut:
        out = out.select(dim, *args) if op == "select" else out.narrow(dim, *args)
    return out
