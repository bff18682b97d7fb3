"""DTensor params (FSDP2 ``fully_shard``, HSDP, ``parallelize_module`` TP, FSDP2 + TP).

The layout comes straight from the DTensor's spec: ``device_mesh.mesh`` gives the global ranks and
the n-d mesh shape, the placements map to ours, and the spec's ``tensor_meta`` gives the global
shape (what ``full_tensor()`` builds; torch's own shard-order test helpers leave the wrapper's outer
size at the local one). The spec's tensor is ``_local_tensor`` (for FSDP2 a narrow view of a padded
buffer; its shape must equal ``layout.local_shape``).

A tensor dim split over several mesh dims is split in a *shard order*, which torch 2.13 carries in
one of three ways (read as its ``redistribute`` does, so ``full_tensor()`` and reshard agree):

- by default, left to right over the mesh dims;
- an explicit ``spec.shard_order`` (``ShardOrderEntry(tensor_dim, mesh_dims)``, first applied first),
  used when ``spec.use_strided_shard_as_shard_order`` is False;
- ``_StridedShard(d, split_factor=sf)`` placements, decoded into an order when that flag is True
  (the default when one is present): each ``_StridedShard`` waits for the mesh dims of ``d`` whose
  sizes multiply to ``sf`` (FSDP2 sharding a TP shard). ``spec.shard_order`` is then ignored.

Either way the mesh dims that split one tensor dim are re-listed in that order, so the first applied
is the outermost, which is exact for uneven splits too. A ``_StridedShard`` that is not read as an
order (flag False, or split factors no order explains) cuts its extent into ``sf`` chunks and each of
those over the mesh dim: ``Shard(d, components=…)``, or ``Shard(d, stride=sf)`` when that is even. If
the extent it cuts differs between ranks (an uneven split came first), it is refused.
"""

from __future__ import annotations

import sys

import torch

from ..layout import Layout, Mesh, Replicate, Shard, chunk_bounds
from ..specs import TensorMeta, TensorSpec
from .context import ExtractContext, ExtractError
from .unwrap import strip_wrappers


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor``.

    That package costs about a second on first import (its op registry pulls in sympy); a DTensor
    cannot exist before it was imported, so a process that never made one never pays for it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def dtensor_shape_and_layout(name: str, tensor) -> tuple[tuple[int, ...], Layout]:
    """Global shape and ``Layout`` of a DTensor, read from its spec (shard order included)."""
    spec = tensor._spec
    meta = getattr(spec, "tensor_meta", None)
    shape = tuple(int(n) for n in (meta.shape if meta is not None else tensor.shape))
    layout = dtensor_layout(
        name,
        shape,
        spec.mesh,
        spec.placements,
        getattr(spec, "shard_order", None),
        getattr(spec, "use_strided_shard_as_shard_order", None),
    )
    return shape, layout


def extract_dtensor(qualname: str, tensor: torch.Tensor, context: ExtractContext) -> list[TensorSpec] | None:
    """Spec of a DTensor param or buffer, or None when ``tensor`` is not a DTensor."""
    if not is_dtensor(tensor):
        return None
    name = strip_wrappers(qualname)
    shape, layout = dtensor_shape_and_layout(name, tensor)
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


def dtensor_layout(
    name: str,
    shape: tuple[int, ...],
    device_mesh,
    placements,
    shard_order=None,
    strided_as_order: bool | None = None,
) -> Layout:
    """Our ``Layout`` for a DTensor of global ``shape`` on ``device_mesh`` with ``placements``.

    Contract: for every rank, ``layout.dim_intervals`` are the global indices that torch's
    ``redistribute``/``full_tensor()`` take that rank's local tensor to hold. ``shard_order`` (torch's
    ``ShardOrderEntry`` tuple, duck typed) and ``strided_as_order`` (the spec's
    ``use_strided_shard_as_shard_order``; None: True when a ``_StridedShard`` is present) say how
    the order is carried, as in the module docstring. Raises ``ExtractError`` when the layout cannot
    be expressed exactly.
    """
    grid = device_mesh.mesh
    ranks = tuple(int(r) for r in grid.flatten().tolist())
    sizes = tuple(int(s) for s in grid.shape)
    placements = tuple(placements)
    if strided_as_order is None:
        strided_as_order = any(_split_factor(p) is not None for p in placements)
    decoded = _decode_strided(placements, sizes) if strided_as_order else None
    if decoded is not None:
        orders = decoded
    elif strided_as_order:
        orders = {}  # torch falls back to reading each placement on its own, left to right
    else:
        orders = _explicit_orders(name, placements, shard_order)
    perm = list(range(len(sizes)))
    for mesh_dims in orders.values():
        for slot, m in zip(sorted(mesh_dims), mesh_dims, strict=True):
            perm[slot] = m
    extents = [{n} for n in shape]  # the local lengths each tensor dim can have so far
    converted = []
    for m in perm:
        shard = _convert(name, placements[m])
        if decoded is None and _split_factor(placements[m]) is not None:
            shard = _strided(name, shape, placements, m, sizes[m], extents[shard.dim])
        if isinstance(shard, Shard):
            parts = [shard.components or (n,) for n in extents[shard.dim]]
            extents[shard.dim] = {
                sum(_chunks(c, sizes[m])[r] for c in p) for p in parts for r in range(sizes[m])
            }
        converted.append(shard)
    if perm != list(range(len(sizes))):
        ranks = tuple(int(r) for r in grid.reshape(sizes).permute(perm).flatten().tolist())
        sizes = tuple(sizes[m] for m in perm)
    return Layout(Mesh(ranks, sizes), tuple(converted))


def _decode_strided(placements, sizes: tuple[int, ...]) -> dict[int, list[int]] | None:
    """Shard order that torch reads from ``_StridedShard`` split factors, or None when none fits.

    Mirrors ``DTensorSpec._maybe_convert_StridedShard_to_shard_order``: right to left, each mesh dim
    goes where the sizes of the mesh dims already ordered before it multiply to its split factor.
    """
    orders: dict[int, list[int]] = {}
    for m in reversed(range(len(placements))):
        p = placements[m]
        if not _is_shard_like(p):
            continue
        mesh_dims = orders.setdefault(int(p.dim), [])
        want, product = _split_factor(p) or 1, 1
        for i in range(len(mesh_dims) + 1):
            if product == want:
                mesh_dims.insert(i, m)
                break
            if i < len(mesh_dims):
                product *= sizes[mesh_dims[i]]
        else:
            return None
    return orders


def _explicit_orders(name: str, placements, shard_order) -> dict[int, list[int]]:
    """``shard_order`` as {tensor dim: mesh dims, first applied first}, checked against ``placements``."""
    orders = {}
    for entry in shard_order or ():
        dim, mesh_dims = int(entry.tensor_dim), [int(m) for m in entry.mesh_dims]
        holders = [m for m, p in enumerate(placements) if _is_shard_like(p) and int(p.dim) == dim]
        if sorted(mesh_dims) != holders:
            raise ExtractError(
                f"tensor '{name}': shard_order entry (tensor dim {dim}, mesh dims {mesh_dims}) does "
                f"not match its placements {placements}"
            )
        orders[dim] = mesh_dims
    return orders


def _is_shard_like(placement) -> bool:
    return placement.is_shard() or _split_factor(placement) is not None  # _StridedShard is no is_shard()


def _split_factor(placement) -> int | None:
    """split_factor of a ``_StridedShard`` (duck typed), else None."""
    sf = getattr(placement, "split_factor", None)
    return None if sf is None else int(sf)


def _convert(name: str, placement) -> Replicate | Shard:
    if placement.is_replicate():
        return Replicate()
    if _is_shard_like(placement):
        return Shard(int(placement.dim))
    if placement.is_partial():
        raise ExtractError(
            f"tensor '{name}': placement {placement!r} is Partial (pending reduction); reduce it "
            f"(e.g. redistribute to Replicate) before resharding"
        )
    raise ExtractError(f"tensor '{name}': unsupported DTensor placement {placement!r}")


def _strided(name: str, shape, placements, m: int, world: int, extents: set[int]) -> Shard:
    """A ``_StridedShard`` on mesh dim ``m`` read on its own: ``sf`` chunks, each cut over the mesh dim."""
    dim, sf = int(placements[m].dim), int(placements[m].split_factor)
    if len(extents) != 1:
        raise ExtractError(
            f"tensor '{name}' of shape {shape}: {placements[m]!r} on mesh dim {m} of {placements} (not "
            f"read as a shard order) cuts an extent of dim {dim} that an earlier uneven split left "
            f"different between ranks ({sorted(extents)}); no layout expresses that exactly"
        )
    (length,) = extents
    if length % (sf * world) == 0:
        return Shard(dim, stride=sf)
    return Shard(dim, components=tuple(_chunks(length, sf)))


def _chunks(length: int, pieces: int) -> list[int]:
    """Sizes of the ``pieces`` pieces ``torch.chunk`` cuts ``length`` into (trailing ones may be empty)."""
    return [b - a for a, b in (chunk_bounds(length, pieces, i) for i in range(pieces))]
