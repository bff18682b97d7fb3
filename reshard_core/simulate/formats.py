"""Offline layout tables of refits across model formats (``reshard plan --src-format/--dst-format``).

Each side is laid out in its own format from a catalogue ``GPTConfig`` and a ``Parallel`` grid,
then described in the logical (HF checkpoint) space, exactly as ``refit`` describes live models:

- ``megatron``: Megatron-Core's parameters on the grid (``layouts.GridLayouts``), mapped by the
  Megatron format (group-major ``linear_qkv``, stride-2 ``linear_fc1``, vocab padded to a multiple
  of ``128·tp``);
- ``vllm``: the vLLM convention (``formats.vllm.vllm_logical_specs``): TP groups of ``tp`` ranks,
  ``dp`` replicas, experts cut over ``dp × tp`` or, with ``ep > 1``, placed whole ("linear");
- ``hf``: a transformers model under FSDP2: every logical tensor ``Shard(0)`` over the ``fsdp``
  ranks, replicated over ``dp``.

``gather_first_bytes`` is what a converter that gathers full tensors first moves: every
destination rank receives whole each logical tensor it holds any piece of (what vLLM's own M2N path
does for fused parameters, and converters that all-gather before converting).
"""

from __future__ import annotations

from math import prod
from types import SimpleNamespace

from ..catalogue.gpt import GPTConfig, gpt_shapes
from ..catalogue.shapes import ModelShapes, ShapeEntry
from ..formats.vllm import VLLMParallel, vllm_logical_specs
from ..layout import Layout, Mesh, Replicate, Shard
from ..plan.table import LayoutTable, TableBuilder
from ..specs import TensorMeta, TensorSpec
from .layouts import GridLayouts
from .parallel import Parallel

FORMATS = ("megatron", "vllm", "hf")
MEGATRON_VOCAB_MULTIPLE = 128
"""Megatron's ``make_vocab_size_divisible_by`` default; the vocab is padded to it times TP."""


def format_table(
    config: GPTConfig, src: Parallel, dst: Parallel, src_format: str, dst_format: str, dst_offset: int = 0
) -> LayoutTable:
    """The logical layout table of refitting ``config`` from ``src`` in ``src_format`` to ``dst``
    (ranks from ``dst_offset``) in ``dst_format``."""
    builder = TableBuilder()
    for side, fmt, par, offset in (("src", src_format, src, 0), ("dst", dst_format, dst, dst_offset)):
        for spec in side_specs(config, par, fmt, offset):
            builder.add(side, spec.layout.mesh.ranks[0], spec.meta, spec.layout)
    return builder.build()


def side_specs(config: GPTConfig, par: Parallel, fmt: str, offset: int = 0) -> list[TensorSpec]:
    """Every logical tensor of one side, laid out in format ``fmt`` (specs without tensors)."""
    if fmt == "megatron":
        return _megatron(config, par, offset)
    if fmt == "vllm":
        return _vllm(config, par, offset)
    if fmt == "hf":
        return _hf(config, par, offset)
    raise ValueError(f"unknown format {fmt!r} for offline planning; use one of {', '.join(FORMATS)}")


def hf_config(config: GPTConfig) -> SimpleNamespace:
    """The transformers-style config of a catalogue model (what the vLLM convention reads), as its
    family names the fields."""
    from ..formats.families import family_of

    shaped = "qwen3_moe" if config.experts else ("qwen3" if config.qk_norm else "llama")
    model_type = config.family or shaped
    if config.experts and not config.family and not config.qk_norm:
        raise ValueError(
            f"{config.name}: an MoE model without q/k norms has no vLLM model type here (qwen3_moe)"
        )
    return family_of(model_type).hf_config(config)


def _megatron(config: GPTConfig, par: Parallel, offset: int) -> list[TensorSpec]:
    from ..formats.megatron import MegatronFormat

    multiple = MEGATRON_VOCAB_MULTIPLE * par.tp
    padded = -(-config.vocab // multiple) * multiple
    shapes = gpt_shapes(config)
    grid = GridLayouts(par, shapes, offset)
    fmt = MegatronFormat(vocab_size=config.vocab, config=megatron_config(config))
    out: list[TensorSpec] = []
    for t in shapes.tensors:
        shape = (padded, *t.shape[1:]) if t.kind == "vocab" else t.shape
        physical = TensorSpec(TensorMeta(t.name, shape, t.dtype), grid.layout(t), None)
        mapped = fmt.map_offline(physical)
        if mapped is None:
            raise ValueError(f"{config.name}: format 'megatron' has no logical tensor for {t.name}")
        out += mapped
    return out


def megatron_config(config: GPTConfig) -> SimpleNamespace:
    """The ``TransformerConfig`` fields the Megatron format reads, from a catalogue model (the ones that
    pick a family included: multi-latent attention, learned softmax offsets, a gated shared expert)."""
    return SimpleNamespace(
        num_attention_heads=config.heads, num_query_groups=config.kv_heads,
        kv_channels=config.head_dim or config.hidden // config.heads, hidden_size=config.hidden,
        ffn_hidden_size=config.ffn, gated_linear_unit=True, num_moe_experts=config.experts or None,
        moe_ffn_hidden_size=config.moe_ffn or None, qk_layernorm=config.qk_norm, num_layers=config.layers,
        share_embeddings_and_output_weights=config.tied, multi_latent_attention=config.mla is not None,
        softmax_type="learnable" if config.sinks else "vanilla",
        moe_shared_expert_gate=config.shared_expert_gate, **_delta_net(config),
    )  # fmt: skip


def _delta_net(config: GPTConfig) -> dict:
    """Qwen3-Next's Megatron settings (as Megatron-Bridge builds it), none for other models."""
    la = config.linear_attention
    if la is None:
        return {}
    return dict(
        experimental_attention_variant="gated_delta_net", attention_output_gate=True,
        layernorm_zero_centered_gamma=True, linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads, linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
    )  # fmt: skip


def _vllm(config: GPTConfig, par: Parallel, offset: int) -> list[TensorSpec]:
    if par.pp != 1 or par.cp != 1 or par.fsdp != 1:
        raise ValueError(f"format 'vllm' takes tp, dp and ep only, not {par}")
    groups = [tuple(offset + d * par.tp + t for t in range(par.tp)) for d in range(par.dp * par.ep)]
    parallel = VLLMParallel(tuple(groups), enable_expert_parallel=par.ep > 1)
    return vllm_logical_specs(hf_config(config), parallel, None)


def _hf(config: GPTConfig, par: Parallel, offset: int) -> list[TensorSpec]:
    if par.tp != 1 or par.pp != 1 or par.cp != 1 or par.ep != 1:
        raise ValueError(f"format 'hf' is laid out by FSDP2 here: fsdp and dp only, not {par}")
    ranks = tuple(range(offset, offset + par.world))
    dims = [(n, p) for n, p in ((par.dp, Replicate()), (par.fsdp, Shard(0))) if n > 1] or [(1, Replicate())]
    layout = Layout(Mesh(ranks, tuple(n for n, _ in dims)), tuple(p for _, p in dims))
    return [TensorSpec(s.meta, layout, None) for s in _logical(config)]


def _logical(config: GPTConfig) -> list[TensorSpec]:
    """Every logical tensor (name, shape, dtype) of a catalogue model, whatever the layout: as the
    Megatron format maps its shapes."""
    return _megatron(config, Parallel(), 0)


def logical_shapes(config: GPTConfig) -> ModelShapes:
    """The catalogue model's logical (HF checkpoint) tensors as ``ModelShapes``: what a plan between
    formats other than Megatron's reports the model by (its Megatron shapes may not exist)."""
    entries = tuple(ShapeEntry(s.meta.name, tuple(s.meta.shape), s.meta.dtype) for s in _logical(config))
    return ModelShapes(config.name, entries, config.layers, config.heads, config.kv_heads)


def gather_first_bytes(table: LayoutTable) -> int:
    """Bytes a gather-first converter moves: each logical tensor, whole, to every destination rank
    holding any piece of it."""
    total = 0
    for entry in table.entries:
        whole = prod(entry.meta.shape) * entry.meta.dtype.itemsize
        for layout in entry.dst:
            holders = [r for r in layout.mesh.ranks if _holds(layout, tuple(entry.meta.shape), r)]
            total += whole * len(holders)
    return total


def shard_to_shard_bytes(table: LayoutTable) -> int:
    """Bytes a shard-to-shard refit moves in all (remote and local): each destination rank's own
    elements, once. Exact whatever ranks a simulation planned (``gather_first_bytes`` is its peer)."""
    total = 0
    for entry in table.entries:
        shape, size = tuple(entry.meta.shape), entry.meta.dtype.itemsize
        for layout in entry.dst:
            total += sum(prod(layout.local_shape(shape, r) or (0,)) for r in layout.mesh.ranks) * size
    return total


def _holds(layout: Layout, shape: tuple[int, ...], rank: int) -> bool:
    local = layout.local_shape(shape, rank)
    return local is not None and prod(local) > 0
