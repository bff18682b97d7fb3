"""DTensor params (FSDP2 ``fully_shard``, HSDP, ``parallelize_module`` TP, FSDP2 + TP).

The layout comes straight from the DTensor: its ``device_mesh.mesh`` tensor gives the global ranks
and the n-d mesh shape, its placements map to ours. The spec's tensor is ``_local_tensor`` (for
FSDP2 a narrow view of a padded buffer; its shape must equal ``layout.local_shape``).

``_StridedShard(d, split_factor=sf)`` records right-to-left sharding (FSDP2 sharding a TP shard):
when the mesh dims after it that ``Shard(d)`` have sizes whose product is ``sf``, we move its mesh
dim behind them, which reproduces the physical sharding exactly, uneven sizes included. Otherwise
it becomes ``Shard(d, stride=sf)``, which agrees with torch only for even splits, so uneven ones
are refused.

A non-default ``shard_order`` (a tensor dim split over several mesh dims in another order than left
to right, kept on the DTensor's spec) is honoured the same way: the mesh dims that split one tensor
dim are re-listed in the recorded order, so the first-applied split is the outermost.
"""

from __future__ import annotations

import math
import sys

import torch

from ..layout import Layout, Mesh, Replicate, Shard
from ..specs import TensorMeta, TensorSpec
from .context import ExtractContext, ExtractError, strip_wrappers


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor``.

    That package costs about a second on first import (its op registry pulls in sympy); a DTensor
    cannot exist before it was imported, so a process that never made one never pays for it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def extract_dtensor(qualname: str, tensor: torch.Tensor, context: ExtractContext) -> list[TensorSpec] | None:
    """Spec of a DTensor param or buffer, or None when ``tensor`` is not a DTensor."""
    if not is_dtensor(tensor):
        return None
    name = strip_wrappers(qualname)
    shape = tuple(tensor.shape)
    shard_order = getattr(getattr(tensor, "_spec", None), "shard_order", None)
    layout = dtensor_layout(name, shape, tensor.device_mesh, tensor.placements, shard_order)
    local = tensor._local_tensor
    expected = layout.local_shape(shape, context.rank)
    if expected is None:
        raise ExtractError(
            f"tensor '{name}': rank {context.rank} is not in its device mesh {layout.mesh.ranks}"
        )
    if tuple(local.shape) != expected:
        raise ExtractError(
            f"tensor '{name}': local shape {tuple(local.shape)} on rank {context.rank} differs from "
            f"{expected} derived from layout {layout} of global shape {shape}"
        )
    return [TensorSpec(TensorMeta(name, shape, tensor.dtype), layout, local)]


def dtensor_layout(name: str, shape: tuple[int, ...], device_mesh, placements, shard_order=None) -> Layout:
    """Our ``Layout`` for a DTensor of global ``shape`` on ``device_mesh`` with ``placements``.

    ``shard_order`` (torch's ``ShardOrderEntry`` tuple, duck typed) gives, per tensor dim, the
    order its mesh dims split it in; None or the default left-to-right order changes nothing.
    """
    grid = device_mesh.mesh
    ranks = tuple(int(r) for r in grid.flatten().tolist())
    sizes = tuple(int(s) for s in grid.shape)
    converted = [_convert(name, p) for p in placements]
    order = _shard_order_permutation(name, placements, shard_order)
    for i, p in enumerate(placements):
        sf = _split_factor(p)
        if sf is None:
            continue
        later = [j for j in range(i + 1, len(sizes)) if _shards(converted[j], p.dim)]
        if later and math.prod(sizes[j] for j in later) == sf:
            order.remove(i)
            order.insert(order.index(later[-1]) + 1, i)
        else:
            _require_even(name, shape, p.dim, sizes, converted, sf)
            converted[i] = Shard(p.dim, stride=sf)
    if order != list(range(len(sizes))):
        ranks = _transpose(ranks, sizes, order)
        sizes = tuple(sizes[k] for k in order)
        converted = [converted[k] for k in order]
    return Layout(Mesh(ranks, sizes), tuple(converted))


def _shard_order_permutation(name: str, placements, shard_order) -> list[int]:
    """Mesh dims re-listed so that each tensor dim's splits run left to right in ``shard_order``."""
    order = list(range(len(placements)))
    for entry in shard_order or ():
        dim, mesh_dims = int(entry.tensor_dim), tuple(int(m) for m in entry.mesh_dims)
        if list(mesh_dims) == sorted(mesh_dims):
            continue  # left to right: what the placements already say
        holders = [
            m for m, p in enumerate(placements) if getattr(p, "dim", None) == dim and not p.is_replicate()
        ]
        if sorted(mesh_dims) != holders or any(_split_factor(placements[m]) is not None for m in holders):
            raise ExtractError(
                f"tensor '{name}': shard_order entry (tensor dim {dim}, mesh dims {list(mesh_dims)}) does "
                f"not match its placements {tuple(placements)}"
            )
        for slot, m in zip(holders, mesh_dims, strict=True):
            order[slot] = m
    return order


def _split_factor(placement) -> int | None:
    """split_factor of a ``_StridedShard`` (duck typed), else None."""
    sf = getattr(placement, "split_factor", None)
    return None if sf is None else int(sf)


def _convert(name: str, placement):
    if placement.is_replicate():
        return Replicate()
    if placement.is_shard() or _split_factor(placement) is not None:  # _StridedShard is no is_shard()
        return Shard(int(placement.dim))
    if placement.is_partial():
        raise ExtractError(
            f"tensor '{name}': placement {placement!r} is Partial (pending reduction); reduce it "
            f"(e.g. redistribute to Replicate) before resharding"
        )
    raise ExtractError(f"tensor '{name}': unsupported DTensor placement {placement!r}")


def _shards(placement, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == dim and placement.stride == 1


def _require_even(name, shape, dim, sizes, converted, sf) -> None:
    cuts = [s for s, p in zip(sizes, converted, strict=True) if isinstance(p, Shard) and p.dim == dim]
    pieces = sf * math.prod(cuts)
    if shape[dim] % pieces:
        raise ExtractError(
            f"tensor '{name}': _StridedShard(dim={dim}, split_factor={sf}) over an extent of "
            f"{shape[dim]} not divisible by {pieces} cannot be expressed exactly"
        )


def _transpose(ranks: tuple[int, ...], sizes: tuple[int, ...], order: list[int]) -> tuple[int, ...]:
    """Ranks of a row-major grid of ``sizes`` re-listed with its dims permuted to ``order``."""
    grid = torch.tensor(ranks).reshape(sizes).permute(order)
    return tuple(int(r) for r in grid.flatten().tolist())
