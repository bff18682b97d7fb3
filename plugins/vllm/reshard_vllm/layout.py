"""A vLLM worker's destination layout, read from vLLM's process groups and checked against its live layers.

Format "vllm" (``reshard_core.formats.vllm``) derives every parameter's layout from the model's
config and a ``VLLMParallel`` (TP groups, expert parallelism, expert placement).
``engine_parallel(model)`` builds that description from vLLM's own TP/DP groups and MoE config, then
checks it against what each live layer says about itself, so a worker whose layers were built
another way (a vLLM release with other rules) is refused by name instead of receiving wrong rows:

- parallel linear layers (column, row, merged, ``QKVParallelLinear``): ``tp_size`` and ``tp_rank``;
- ``QKVParallelLinear``: ``num_kv_heads`` and ``num_kv_head_replicas`` (kv heads replicated when TP
  exceeds them);
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the padded vocabulary and this rank's slice of it;
- routed experts: how many experts this rank holds (all of them, TP-cut, unless expert parallel).
"""

from __future__ import annotations

import sys
from typing import Any

from reshard_core import FormatError, ReshardError
from reshard_core.formats import VOCAB_PADDING, VLLMParallel, routed_experts


def engine_parallel(model: Any, rank: int) -> VLLMParallel:
    """The ``VLLMParallel`` of the live vLLM ``model`` on vLLM rank ``rank`` (vLLM's own world's ranks).

    Raises ``FormatError`` naming the first layer whose attributes disagree with it.
    """
    parallel = parallel_from_vllm(model)
    config = getattr(model, "config", None)
    problems = [
        p for name, layer in model.named_modules() for p in _check(name, layer, parallel, rank, config)
    ]
    if problems:
        raise FormatError(
            f"format 'vllm' on vLLM rank {rank}: the live layers disagree with the layout read from "
            f"vLLM's groups {parallel}: "
            + "; ".join(problems[:4])
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        )
    return parallel


def _check(name: str, layer: Any, par: VLLMParallel, rank: int, config: Any) -> list[str]:
    kind = type(layer).__name__
    where = f"{name} ({kind})"
    tp_rank = next(g.index(rank) for g in par.tp_groups if rank in g)
    out = []
    if hasattr(layer, "tp_size") and hasattr(layer, "tp_rank") and hasattr(layer, "output_sizes"):
        if (layer.tp_size, layer.tp_rank) != (par.tp_size, tp_rank) and layer.tp_size != 1:
            out.append(f"{where} has tp_size {layer.tp_size}, tp_rank {layer.tp_rank}, "
                       f"expected {par.tp_size}, {tp_rank}")  # fmt: skip
    if hasattr(layer, "num_kv_head_replicas") and hasattr(layer, "total_num_kv_heads"):
        kv = layer.total_num_kv_heads
        replicas = par.tp_size // kv if par.tp_size >= kv else 1
        heads = 1 if par.tp_size >= kv else kv // par.tp_size
        if (layer.num_kv_heads, layer.num_kv_head_replicas) != (heads, replicas):
            out.append(f"{where} holds {layer.num_kv_heads} kv heads with {layer.num_kv_head_replicas} "
                       f"replicas, expected {heads} with {replicas}")  # fmt: skip
    indices = getattr(layer, "shard_indices", None)
    if indices is not None and hasattr(layer, "num_embeddings_padded") and hasattr(layer, "org_vocab_size"):
        padded = -(-layer.org_vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // par.tp_size
        if (layer.num_embeddings_padded, indices.padded_org_vocab_start_index) != (padded, tp_rank * per):
            start = indices.padded_org_vocab_start_index
            out.append(f"{where} pads the vocabulary to {layer.num_embeddings_padded} rows from row "
                       f"{start}, expected {padded} from {tp_rank * per}")  # fmt: skip
    local = getattr(layer, "local_num_experts", None)
    experts = routed_experts(config) if isinstance(local, int) and config is not None else 0
    if experts:
        expected = len(par.experts_of(experts)[par.ranks.index(rank)]) if par.use_ep else experts
        if local != expected:
            out.append(f"{where} holds {local} experts, expected {expected}")
    return out


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
            f"format 'vllm': vLLM's process groups are not available ({exc}); outside a vLLM worker, "
            "declare the model's layout with reshard_core.formats.declare_vllm"
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


def check_refittable(model: Any, rank: int) -> None:
    """Raise ``ReshardError`` when format "vllm" cannot refit this live vLLM ``model`` on vLLM rank
    ``rank``: its model type or sizes have no mapping, its checkpoint-layout parameters are not the
    ones the format derives from its config (names and local shapes, all listed), or an attention
    backend keeps no weights to refit. Checked when a trainer initialises, before any data moves."""
    from reshard_core.formats import VLLMFormat, declare_vllm

    from .reload import checkpoint_weights

    backend = refused_backend(model)
    if backend:
        raise ReshardError(backend)
    declare_vllm(model, engine_parallel(model, rank))
    found = VLLMFormat().resolve(model, checkpoint_weights(model), rank)
    if found.unmapped:
        more = len(found.unmapped) - 6
        names = ", ".join(found.unmapped[:6]) + (f" (and {more} more)" if more > 0 else "")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ReshardError(
            f"format 'vllm' maps no logical tensor to {len(found.unmapped)} parameter"
            f"{'s' if len(found.unmapped) != 1 else ''} of this {model_type!r} engine: {names}"
        )


REFUSED_BACKENDS = {
    "AMX_MLA": (
        "it packs kv_b_proj into its own kernel and frees the weight, so there is nothing to refit in "
        "place; start the engine with --attention-backend CPU_MLA"
    ),
}
"""vLLM attention backends whose layers keep no refittable weights, and what to choose instead."""


def refused_backend(model: Any) -> str:
    """Why an attention backend of ``model`` cannot be refit ("" when none is refused)."""
    for name, layer in model.named_modules():
        backend = getattr(layer, "attn_backend", None)
        get_name = getattr(backend, "get_name", None)
        chosen = get_name() if callable(get_name) else None
        if chosen in REFUSED_BACKENDS:
            return f"reshard: layer {name} uses vLLM's {chosen} attention backend: {REFUSED_BACKENDS[chosen]}"
    return ""
