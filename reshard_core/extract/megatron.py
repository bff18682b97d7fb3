"""Megatron-style params, read by duck typing (megatron is never imported here).

Claims every tensor of a module tree that carries a ``pg_collection`` (nearest owning module,
else any ancestor), and any tensor with Megatron's TP attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``, ``partition_sizes``, ``allreduce``). Groups come from that
``pg_collection``; without one, from ``megatron.core.parallel_state`` only if the caller's program
already imported and initialised it.

A parameter Megatron splits without marking it (``core_attention.softmax_offset``, one per local
head) is split by name (``_UNMARKED_SPLITS``).

Groups per param: expert params (``allreduce is False``, or any tensor under an ``experts`` module
whatever ``allreduce`` says, as Megatron sets it True for experts when EP is 1) split over
``expt_tp`` (else ``tp``) and are replicated over ``expt_dp``; the others split over ``tp`` and are
replicated over ``dp_cp`` (else ``dp``). Params without TP attributes are replicated over both.

Mesh: ``(replicas, tp)`` as a 2-d grid when ``context.replica_grid`` (default), built as
``rank(j, i) = D[j] + T[i] - me`` from this rank's replica roster D and TP roster T. That is exact
for groups cut from one rank grid (Megatron's RankGenerator and HyperCommGrid do so). Should a
rank's own rosters contradict the grid, its layout differs from its mesh leader's, which the
layout exchange's holding digest reports as an error naming the tensor and ranks. Without the grid
(or if it would leave the world), the mesh is the TP group alone and each replica group reports
its own layout under the same name (replicas to the planner). Size-1 mesh dims are dropped.

Names: stage-local ``decoder.layers.K`` becomes ``decoder.layers.{layer_number - 1}`` (longest
owning module with an int ``layer_number`` and a numeric last name part, as Megatron's refit does);
``experts.local_experts.K`` and TE grouped ``experts.linear_fc1.weightK`` / ``biasK`` get global
expert index ``ep_rank * num_local + K``. With tied embeddings under PP>1 the last stage holds its
own copy of the word embeddings as ``output_layer.weight`` (marked ``shared_embedding`` by
Megatron, or owned by a model with ``share_embeddings_and_output_weights``): it is reported as
another replica of ``embedding.word_embeddings.weight``, so tied models of any PP size match.
"""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace
from typing import Any

import torch

from ..layout import Layout, Mesh, Replicate, Shard
from ..specs import TensorMeta, TensorSpec
from .context import ExtractContext, ExtractError
from .unwrap import strip_wrappers

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_sizes", "allreduce")
_UNMARKED_SPLITS = {"softmax_offset": 0}
"""Megatron parameters split over TP that carry no TP attributes (only their ``sharded_state_dict``
names the axis): ``core_attention.softmax_offset``, the learned softmax offsets (GPT-OSS's sinks),
one per local head."""
_GROUPED = re.compile(r"^(weight|bias)(\d+)$")


class _ModelInfo:
    """Per-model facts, computed once: modules by name, pg_collection owners, layer renames."""

    def __init__(self, model: torch.nn.Module, context: ExtractContext) -> None:
        self.modules = context.modules(model)
        self.pg_owners = {n for n, m in self.modules.items() if getattr(m, "pg_collection", None) is not None}
        self.layer_map: dict[str, str] = {}
        for mod_name, mod in self.modules.items():
            number = getattr(mod, "layer_number", None)
            parts = mod_name.split(".")
            if mod_name and isinstance(number, int) and not isinstance(number, bool) and parts[-1].isdigit():
                self.layer_map[mod_name] = ".".join([*parts[:-1], str(number - 1)])

    def pg_collection(self, qualname: str) -> Any:
        """``pg_collection`` of the nearest module owning ``qualname`` (the root included), or None."""
        parts = qualname.split(".")
        for i in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.pg_owners:
                return self.modules[prefix].pg_collection
        return None


def extract_megatron(
    qualname: str,
    tensor: torch.Tensor,
    owner: torch.nn.Module,
    model: torch.nn.Module,
    context: ExtractContext,
) -> list[TensorSpec] | None:
    """Spec of a Megatron-style tensor, or None when neither a pg_collection nor TP attributes apply."""
    info: _ModelInfo = context.cached(("megatron", id(model)), lambda: _ModelInfo(model, context))
    pgs = info.pg_collection(qualname)
    if pgs is None:
        if not any(hasattr(tensor, a) for a in _TP_ATTRS):
            return None
        pgs = _parallel_state_groups(qualname)
    # EP=1 leaves experts with allreduce=True, yet they still split over expert TP
    is_expert = getattr(tensor, "allreduce", True) is False or "experts" in qualname.split(".")[:-1]
    name = _canonical_name(qualname, tensor, owner, info, pgs, is_expert, context)
    tp_group = _group(pgs, "expt_tp", "tp") if is_expert else _group(pgs, "tp")
    rep_group = _group(pgs, "expt_dp") if is_expert else _group(pgs, "dp_cp", "dp")
    tp = context.group_ranks(tp_group) if tp_group is not None else (context.rank,)
    reps = context.group_ranks(rep_group) if rep_group is not None else (context.rank,)
    for label, roster in (("tensor-parallel", tp), ("replica", reps)):
        if context.rank not in roster:
            raise ExtractError(f"tensor '{name}': rank {context.rank} is not in its {label} group {roster}")
    placement, shape = _tp_placement(name, tensor, len(tp), _grouped_glu_fc1(qualname, owner, model))
    layout = _layout(tp, reps, placement, context)
    return [TensorSpec(TensorMeta(name, shape, tensor.dtype), layout, tensor)]


def _group(pgs: Any, *names: str) -> Any:
    for n in names:
        group = getattr(pgs, n, None)
        if group is not None:
            return group
    return None


def _parallel_state_groups(qualname: str) -> Any:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        raise ExtractError(
            f"tensor '{qualname}' has Megatron tensor-parallel attributes but no module above it has a "
            f"pg_collection and megatron.core.parallel_state is not initialised"
        )
    return SimpleNamespace(
        tp=ps.get_tensor_model_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        ep=ps.get_expert_model_parallel_group(),
        expt_tp=ps.get_expert_tensor_parallel_group(),
        expt_dp=ps.get_expert_data_parallel_group(),
    )


def _grouped_glu_fc1(qualname: str, owner: torch.nn.Module, model: torch.nn.Module) -> bool:
    """A TE grouped-GEMM expert ``linear_fc1.weightK`` of a gated MLP. TE stamps it
    ``partition_stride=1``, yet each rank holds ``[gate_r; up_r]`` like the dense gated fc1."""
    parts = qualname.split(".")
    if len(parts) < 2 or parts[-2] != "linear_fc1" or not _GROUPED.match(parts[-1]):
        return False
    if getattr(owner, "num_gemms", None) is None:
        return False
    config = getattr(owner, "config", None) or getattr(model, "config", None)
    return bool(getattr(config, "gated_linear_unit", False))


def _tp_placement(
    name: str, tensor: torch.Tensor, width: int, gated_grouped: bool = False
) -> tuple[Any, tuple[int, ...]]:
    """TP placement and global shape of ``tensor`` split ``width`` ways (``gated_grouped``: a TE
    grouped gated fc1, whose rank pieces are ``[gate_r; up_r]`` whatever its stride says)."""
    local = tuple(tensor.shape)
    if not getattr(tensor, "tensor_model_parallel", False):
        unmarked = _UNMARKED_SPLITS.get(name.rsplit(".", 1)[-1])
        if unmarked is None or width == 1:
            return Replicate(), local
        return Shard(unmarked), tuple(n * width if d == unmarked else n for d, n in enumerate(local))
    dim = int(getattr(tensor, "partition_dim", 0))
    stride = int(getattr(tensor, "partition_stride", 1))
    if gated_grouped and dim == 0 and stride == 1:
        stride = 2
    sizes = tuple(int(b) for b in (getattr(tensor, "partition_sizes", None) or ()))
    if not 0 <= dim < len(local):
        raise ExtractError(f"tensor '{name}': partition_dim={dim} is out of range for local shape {local}")
    if sizes and sum(sizes) != local[dim]:
        raise ExtractError(
            f"tensor '{name}': partition_sizes {list(sizes)} sum to {sum(sizes)}, "
            f"local dim {dim} is {local[dim]}"
        )
    if local[dim] % stride:
        raise ExtractError(
            f"tensor '{name}': partition_stride={stride} does not divide local dim {dim} ({local[dim]})"
        )
    shape = list(local)
    shape[dim] *= width
    if sizes:
        return Shard(dim, components=tuple(b * width for b in sizes)), tuple(shape)
    return Shard(dim, stride=stride), tuple(shape)


def _layout(tp: tuple[int, ...], reps: tuple[int, ...], placement: Any, context: ExtractContext) -> Layout:
    """Layout over the (replicas, tp) grid, or over the TP group alone."""
    me = context.rank
    grid = [[r + t - me for t in tp] for r in reps]
    flat = [r for row in grid for r in row]
    inside = all(0 <= r < context.world for r in flat) and len(set(flat)) == len(flat)
    use_grid = context.replica_grid and len(reps) > 1 and inside
    dims: list[tuple[int, Any]] = []
    if use_grid:
        dims.append((len(reps), Replicate()))
    else:
        flat = list(tp)
    if len(tp) > 1:
        dims.append((len(tp), placement))
    if not dims:
        return Layout(Mesh((me,), (1,)), (Replicate(),))
    return Layout(Mesh(tuple(flat), tuple(s for s, _ in dims)), tuple(p for _, p in dims))


def _canonical_name(
    qualname: str,
    tensor: torch.Tensor,
    owner: torch.nn.Module,
    info: _ModelInfo,
    pgs: Any,
    is_expert: bool,
    context: ExtractContext,
) -> str:
    """Global layer and expert indices in place of stage/EP-local ones, wrapper parts dropped."""
    local = qualname.split(".")
    parts = list(local)
    if is_expert or hasattr(owner, "num_local_experts"):
        _globalize_expert(qualname, parts, owner, info, pgs, context)
    for i in range(len(parts) - 1, 0, -1):
        mapped = info.layer_map.get(".".join(local[:i]))
        if mapped is not None:
            parts[i - 1] = mapped.rsplit(".", 1)[-1]
            break
    if parts[-2:] == ["output_layer", "weight"] and _tied_output(tensor, info, ".".join(local[:-2])):
        parts[-2:] = ["embedding", "word_embeddings", "weight"]
    return strip_wrappers(".".join(parts))


def _tied_output(tensor: torch.Tensor, info: _ModelInfo, model_name: str) -> bool:
    """Whether ``tensor`` (an ``output_layer.weight``) is the last stage's copy of tied embeddings."""
    if getattr(tensor, "shared_embedding", False):
        return True
    return getattr(info.modules.get(model_name), "share_embeddings_and_output_weights", False) is True


def _globalize_expert(qualname, parts, owner, info, pgs, context) -> None:
    """Rewrite the local expert index in ``parts`` (in place) to the global one."""
    grouped = _GROUPED.match(parts[-1])
    if grouped is not None and getattr(owner, "num_gemms", None) is None:
        if hasattr(owner, "num_local_experts"):
            raise ExtractError(
                f"tensor '{qualname}': stacked expert weights (legacy GroupedMLP) are not supported; "
                f"use SequentialMLP or Transformer Engine grouped-GEMM experts"
            )
        grouped = None
    group = _group(pgs, "ep")
    ep = context.group_ranks(group) if group is not None else (context.rank,)
    if context.rank not in ep:
        raise ExtractError(
            f"tensor '{qualname}': rank {context.rank} is not in its expert-parallel group {ep}"
        )
    ep_rank = ep.index(context.rank)
    if "local_experts" in parts:
        k = len(parts) - 1 - parts[::-1].index("local_experts")
        if k + 1 < len(parts) and parts[k + 1].isdigit():
            num_local = len(info.modules[".".join(parts[: k + 1])])
            parts[k + 1] = str(ep_rank * num_local + int(parts[k + 1]))
            return
    if grouped is not None:
        parts[-1] = f"{grouped.group(1)}{ep_rank * int(owner.num_gemms) + int(grouped.group(2))}"
