"""vLLM's parallel layers as blocks of an engine table: which logical tensors fill which cut of each
parameter on one rank.

A family (``formats/families/``) describes its vLLM model as a sequence of these blocks, one per
vLLM layer it builds; each block knows how that vLLM layer class splits its parameters over the
tensor-parallel ranks (TP size ``T``, rank ``d``), as vLLM 0.32 does:

- ``vocab``: ``VocabParallelEmbedding`` / ``ParallelLMHead``, rows padded to a multiple of 64, then
  ``V_pad/T`` rows per rank; rows past V are padding;
- ``replicated``: a norm, a router, anything every rank holds whole (``ReplicatedLinear``, a layer
  built with ``disable_tp``, ``RMSNorm``);
- ``column``: ``ColumnParallelLinear`` / ``MergedColumnParallelLinear``: each logical part's rows are
  split over TP, and rank d holds ``[part_1 rows of d; part_2 rows of d; ...]`` (``gate_up_proj``);
- ``replicated_rows``: the same parts stacked whole on every rank (``fused_qkv_a_proj``);
- ``heads``: a parameter cut by heads over TP (``attn.sinks``);
- ``components``: a parameter whose rows are parts, each split over TP (Qwen3-Next's ``conv1d``);
- ``qkv``: ``QKVParallelLinear`` (``[q_d; k_d; v_d]``, kv heads replicated when TP exceeds them);
- ``row``: ``RowParallelLinear`` (columns split over TP; the bias whole on every rank);
- ``experts``: ``FusedMoE``'s ``w13`` / ``w2`` (every expert cut over ``M = DP × TP`` ranks, or whole
  experts under expert parallelism), optionally with biases and GPT-OSS's interleaved gate/up rows.

Names: each block takes the vLLM module name (``model.layers.0.self_attn.qkv_proj``) and the logical
(HF checkpoint) names it holds; ``.weight`` / ``.bias`` are appended.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import FormatError
from ..layout import Layout, Placement, Replicate, Shard
from .cuts import Cut, EngineTable, Every, Narrow, Select
from .vllm_parallel import VLLMParallel

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocab is padded to a multiple of it, then split over TP."""


class VLLMBlocks:
    """The engine table of one rank (None: every logical tensor, for offline planning) of a vLLM
    engine laid out as ``par``, built block by block."""

    def __init__(self, par: VLLMParallel, rank: int | None) -> None:
        if rank is not None and rank not in par.ranks:
            raise FormatError(f"format 'vllm': rank {rank} is not in the parallel description {par}")
        self.par = par
        self.flat = par.ranks.index(rank) if rank is not None else None  # this rank's index in par.ranks
        self.t = EngineTable("vllm", rank, "the config and parallel description")

    # ------------------------------------------------------------------ layouts

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

    def divided(self, what: str, n: int, by_what: str = "the TP size", by: int | None = None) -> int:
        """``n`` split over the TP size (or ``by``); ``FormatError`` naming ``what`` if it does not divide."""
        return self.t.divided(what, n, self.par.tp_size if by is None else by, by_what)

    # ------------------------------------------------------------------ blocks

    def vocab(self, module: str, logical: str, vocab: int, hidden: int) -> None:
        """``VocabParallelEmbedding`` / ``ParallelLMHead`` ``module`` holding ``logical [vocab, hidden]``."""
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        param = f"{module}.weight"
        self.t.param(param, (self.divided("the padded vocab", padded), hidden))
        self.t.unpadded(f"{logical}.weight", (padded, hidden), self.dense(Shard(0)), 0, vocab, param)

    def replicated(
        self, param: str, logical: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> None:
        """Parameter ``param`` is ``logical`` whole on every rank (``dtype``: kept whatever the model's)."""
        self.t.whole(logical, shape, self.flat_layout(Replicate()), param, dtype)

    def norm(self, module: str, size: int, logical: str = "") -> None:
        """An ``RMSNorm`` (replicated) named ``module`` in both conventions (or ``logical`` in HF's)."""
        self.replicated(f"{module}.weight", f"{logical or module}.weight", (size,))

    def column(self, module: str, parts: Sequence[tuple[str, int]], cols: int, *, bias: bool = False) -> None:
        """``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` ``module``: rank d holds rows
        ``[part_1 of d; part_2 of d; ...]`` of the logical ``parts`` ``(name, rows)``."""
        local = [(name, self.divided(f"{name} rows", rows), rows) for name, rows in parts]
        total = sum(n for _, n, _ in local)
        for kind, shape in (("weight", (cols,)), ("bias", ())):
            if kind == "bias" and not bias:
                continue
            param = f"{module}.{kind}"
            self.t.param(param, (total, *shape))
            at = 0
            for name, n, rows in local:
                self.t.piece(
                    f"{name}.{kind}", (rows, *shape), self.dense(Shard(0)), param, (Narrow(0, at, n),)
                )
                at += n

    def replicated_rows(self, module: str, parts: Sequence[tuple[str, int]], cols: int) -> None:
        """A merged linear built with ``disable_tp``: the logical ``parts`` stacked whole on every rank."""
        param, at = f"{module}.weight", 0
        self.t.param(param, (sum(n for _, n in parts), cols))
        for name, rows in parts:
            layout = self.flat_layout(Replicate())
            self.t.piece(f"{name}.weight", (rows, cols), layout, param, (Narrow(0, at, rows),))
            at += rows

    def heads(self, param: str, logical: str, size: int, dtype: torch.dtype | None = None) -> None:
        """A per-head parameter cut by heads over TP (GPT-OSS's ``attn.sinks``, Qwen3-Next's ``A_log``;
        ``dtype``: kept whatever the model's)."""
        self.t.param(param, (self.divided(logical, size),))
        self.t.piece(logical, (size,), self.dense(Shard(0)), param, (), dtype)

    def components(self, param: str, shape: tuple[int, ...], parts: Sequence[int]) -> None:
        """A parameter that is its logical tensor (``shape``) whose dim 0 concatenates ``parts``, each
        split over TP: rank d holds ``[part_1 of d; part_2 of d; ...]`` (Qwen3-Next's ``conv1d``)."""
        local = [self.divided(f"{param} rows", n) for n in parts]
        self.t.param(param, (sum(local), *shape[1:]))
        self.t.piece(param, shape, self.dense(Shard(0, components=tuple(parts))), param)

    def row(self, module: str, logical: str, rows: int, cols: int, *, bias: bool = False) -> None:
        """``RowParallelLinear`` ``module`` holding ``logical [rows, cols]``: columns split over TP,
        the bias whole on every rank (vLLM adds it on TP rank 0 only)."""
        param = f"{module}.weight"
        self.t.param(param, (rows, self.divided(f"{logical} columns", cols)))
        self.t.piece(f"{logical}.weight", (rows, cols), self.dense(Shard(1)), param)
        if bias:
            self.replicated(f"{module}.bias", f"{logical}.bias", (rows,))

    def qkv(
        self, module: str, logical: str, heads: int, kv_heads: int, head_dim: int, hidden: int, *, bias: bool
    ) -> None:
        """``QKVParallelLinear`` ``module`` holding ``{logical}.{q,k,v}_proj``: ``[q_d; k_d; v_d]`` with
        ``heads/T`` query heads and ``kv_heads/T`` kv heads, or one kv head (``d // (T/kv_heads)``)
        replicated over ``T/kv_heads`` ranks when ``T > kv_heads``."""
        self.qkv_heads(module, logical, heads, kv_heads, head_dim, head_dim, hidden, bias=bias)

    def qkv_heads(
        self,
        module: str,
        logical: str,
        heads: int,
        kv_heads: int,
        head_dim: int,
        q_head_rows: int,
        hidden: int,
        *,
        bias: bool,
    ) -> None:
        """``qkv`` whose query heads are ``q_head_rows`` rows each (Qwen3-Next's query and output
        gate rows of each head)."""
        t = self.par.tp_size
        q = self.divided("num_attention_heads", heads)
        if t <= kv_heads:
            kv, kv_layout = self.divided("num_key_value_heads", kv_heads), self.dense(Shard(0))
        else:
            self.t.divided("the TP size", t, kv_heads, "num_key_value_heads")
            kv, kv_layout = 1, self.kv_replicated(kv_heads)
        h = head_dim
        rows = {"q_proj": (0, q * q_head_rows), "k_proj": (q * q_head_rows, kv * h)}
        rows["v_proj"] = (q * q_head_rows + kv * h, kv * h)
        full = {"q_proj": heads * q_head_rows, "k_proj": kv_heads * h, "v_proj": kv_heads * h}
        layouts = {"q_proj": self.dense(Shard(0)), "k_proj": kv_layout, "v_proj": kv_layout}
        for kind, cols in (("weight", (hidden,)), ("bias", ())):
            if kind == "bias" and not bias:
                continue
            param = f"{module}.{kind}"
            self.t.param(param, (q * q_head_rows + 2 * kv * h, *cols))
            for part, (start, n) in rows.items():
                self.t.piece(
                    f"{logical}.{part}.{kind}",
                    (full[part], *cols),
                    layouts[part],
                    param,
                    (Narrow(0, start, n),),
                )

    def mlp(self, module: str, logical: str, inter: int, hidden: int, *, bias: bool = False) -> None:
        """A gated MLP: ``gate_up_proj`` (merged column) and ``down_proj`` (row) of ``module`` holding
        ``{logical}.{gate,up,down}_proj``."""
        parts = [(f"{logical}.gate_proj", inter), (f"{logical}.up_proj", inter)]
        self.column(f"{module}.gate_up_proj", parts, hidden, bias=bias)
        self.row(f"{module}.down_proj", f"{logical}.down_proj", hidden, inter, bias=bias)

    def experts(
        self,
        module: str,
        logical: str,
        experts: int,
        inter: int,
        hidden: int,
        *,
        bias: bool = False,
        interleaved: bool = False,
    ) -> None:
        """``FusedMoE`` ``module`` (``w13_weight [E_local, 2I/M, H]``, ``w2_weight [E_local, H, I/M]``)
        holding ``{logical}.{e}.{gate,up,down}_proj``. Without expert parallelism every expert is cut
        over all ``M = DP × TP`` ranks (flattened); with it, ``DP × TP`` ranks hold whole experts.
        ``interleaved``: ``w13`` holds gate and up rows alternately (GPT-OSS), else gate rows, then up
        rows. ``bias``: ``w13_bias [E_local, 2I/M]`` cut like the rows, and ``w2_bias [E_local, H]``
        whole on the first rank holding the expert and zero (padding) on the others."""
        par = self.par
        if par.use_ep:
            owned = par.experts_of(experts)
            sizes = (len(owned[self.flat]) if self.flat is not None else 0, inter)
            placed = [(par.ranks[j], k, e) for j, mine in enumerate(owned) for k, e in enumerate(mine)]
        else:
            il = self.t.divided("moe_intermediate_size", inter, len(par.ranks), "DP × TP")
            sizes = (experts, il)
            placed = [(None, e, e) for e in range(experts)]
        w13, w2 = f"{module}.w13_weight", f"{module}.w2_weight"
        self.t.param(w13, (sizes[0], 2 * sizes[1], hidden))
        self.t.param(w2, (sizes[0], hidden, sizes[1]))
        if bias:
            self.t.param(f"{module}.w13_bias", (sizes[0], 2 * sizes[1]))
            self.t.param(f"{module}.w2_bias", (sizes[0], hidden))
        il = sizes[1]
        gate = (Every(0, 0, 2),) if interleaved else (Narrow(0, 0, il),)
        up = (Every(0, 1, 2),) if interleaved else (Narrow(0, il, il),)
        for owner, k, e in placed:
            whole = self.t.layout((owner,), (1,), Replicate()) if owner is not None else None
            rows, cols = whole or self.flat_layout(Shard(0)), whole or self.flat_layout(Shard(1))
            name, pick = f"{logical}.{e}", (Select(0, k),)
            self.t.piece(f"{name}.gate_proj.weight", (inter, hidden), rows, w13, pick + gate)
            self.t.piece(f"{name}.up_proj.weight", (inter, hidden), rows, w13, pick + up)
            self.t.piece(f"{name}.down_proj.weight", (hidden, inter), cols, w2, pick)
            if bias:
                self.t.piece(f"{name}.gate_proj.bias", (inter,), rows, f"{module}.w13_bias", pick + gate)
                self.t.piece(f"{name}.up_proj.bias", (inter,), rows, f"{module}.w13_bias", pick + up)
                self._first_rank_bias(f"{module}.w2_bias", f"{name}.down_proj.bias", hidden, whole, pick)

    def _first_rank_bias(self, param: str, logical: str, size: int, whole: Layout | None, pick: Cut) -> None:
        """A down-projection bias vLLM adds once: whole on the expert's first rank, zero elsewhere."""
        first = whole or self.t.layout((self.par.ranks[0],), (1,), Replicate())
        self.t.piece(logical, (size,), first, param, pick)
        if whole is None and self.flat not in (None, 0):
            self.t.pad(param, pick)
