"""The moves a format maps a physical spec onto logical tensors with.

Each takes one ``TensorSpec`` of a physical tensor (its global shape, its layout over ranks, this
rank's local tensor, possibly ``None`` for offline planning) and returns the spec(s) of logical
tensors it holds: the logical layout derived from the physical one, and the local tensor as a
*view* of the physical local tensor, so a refit reads and writes the parameter in place.

- ``rename``: the same tensor under its logical name.
- ``permute``: a transposed storage (an engine keeping ``W.T``).
- ``split``: a fused dim of concatenated parts (``[gate; up]``, ``[q; k; v]`` of one rank) —
  unsharded, ``Shard(dim, stride=k)`` (Megatron's gated fc1) or ``Shard(dim, components=…)``.
- ``select``: one index of a stacked dim (an expert of ``[E, 2I, H]``); ranks not holding it get
  no spec.
- ``regroup``: a dim made of blocks, of which each logical tensor takes the same stretch
  (Megatron's group-major ``linear_qkv``, also with TP > query groups or rotary pairs).
- ``halves``: rotary pairs regrouped into halves along an unsharded dim (a q/k norm weight).
- ``every``: every ``step``-th index of an unsharded dim (GPT-OSS's gate and up columns, interleaved).
- ``components``: a dim sharded per component (``[Q_r | K_r | V_r]`` on rank r), so marked.
- ``assembled``: a local tensor laid out otherwise than the logical one, assembled from stretches
  (Megatron's Qwen3-Next ``in_proj``), or stored with an offset (a norm weight kept as ``w - 1``).
- ``unpad``: a padded dim whose first ``size`` indices are real (a vocab padded for TP); returns
  the local padding too, which a destination zero-fills once and a source never sends.

A move that the physical layout does not allow (a split across an uneven shard, say) raises
``FormatError`` naming the tensor. Engines whose parameters carry no layout at all are described
with the cut language of ``cuts.py`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from itertools import product

import torch

from ..errors import FormatError
from ..layout import Layout, Mesh, Replicate, Shard, chunk_bounds
from ..specs import TensorMeta, TensorSpec
from ..views import PiecewiseView, SplitView


def rename(spec: TensorSpec, name: str) -> TensorSpec:
    """``spec`` under the logical ``name``."""
    return replace(spec, meta=replace(spec.meta, name=name))


def permute(spec: TensorSpec, dims: Sequence[int], name: str) -> TensorSpec:
    """Logical dim ``i`` is physical dim ``dims[i]`` (``(1, 0)``: the physical tensor is ``W.T``)."""
    dims = tuple(dims)
    where = {d: i for i, d in enumerate(dims)}
    placements = tuple(
        replace(p, dim=where[p.dim]) if isinstance(p, Shard) else p for p in spec.layout.placements
    )
    shape = tuple(spec.meta.shape[d] for d in dims)
    tensor = _local(spec, name).permute(dims) if spec.tensor is not None else None
    return TensorSpec(TensorMeta(name, shape, spec.meta.dtype), Layout(spec.layout.mesh, placements), tensor)


def split(spec: TensorSpec, dim: int, parts: Sequence[tuple[str, int]], rank: int) -> list[TensorSpec]:
    """The logical tensors ``(name, full size)`` concatenated along ``dim`` of ``spec``, in order."""
    sizes = [n for _, n in parts]
    if sum(sizes) != spec.meta.shape[dim]:
        raise FormatError(
            f"{spec.meta.name}: parts {dict(parts)} sum to {sum(sizes)} along dim {dim}, "
            f"the tensor has {spec.meta.shape[dim]}"
        )
    cutting = _cutting(spec.layout, dim)
    placements = tuple(spec.layout.placements)
    if not cutting:
        local_sizes = sizes
    elif len(cutting) == 1:
        m, shard = cutting[0]
        width = spec.layout.mesh.shape[m]
        coord = spec.layout.mesh.coord_of(rank)
        local_sizes = _local_part_sizes(spec, shard, sizes, width, coord[m] if coord else 0)
        placements = tuple(Shard(dim) if p is shard else p for p in placements)
    else:
        raise FormatError(f"{spec.meta.name}: cannot split dim {dim}, {len(cutting)} mesh dims shard it")
    out, at = [], 0
    for (name, size), local in zip(parts, local_sizes, strict=True):
        shape = tuple(size if d == dim else n for d, n in enumerate(spec.meta.shape))
        tensor = _local(spec, name).narrow(dim, at, local) if spec.tensor is not None else None
        at += local
        meta = TensorMeta(name, shape, spec.meta.dtype)
        out.append(TensorSpec(meta, Layout(spec.layout.mesh, placements), tensor))
    return out


def _local_part_sizes(spec: TensorSpec, shard: Shard, sizes: list[int], width: int, index: int) -> list[int]:
    if shard.components and tuple(shard.components) == tuple(sizes):
        return [b - a for a, b in (chunk_bounds(n, width, index) for n in sizes)]
    if shard.stride == len(sizes) and len(set(sizes)) == 1 and sizes[0] % width == 0:
        return [sizes[0] // width] * len(sizes)
    raise FormatError(
        f"{spec.meta.name}: parts of sizes {tuple(sizes)} cannot be cut out of a {shard!r} "
        f"shard over {width} ranks"
    )


def select(spec: TensorSpec, dim: int, index: int, name: str, rank: int) -> TensorSpec | None:
    """Index ``index`` of the stacked dim ``dim`` (dropped); None when this rank does not hold it."""
    layout, shape = spec.layout, tuple(spec.meta.shape)
    if not 0 <= index < shape[dim]:
        raise FormatError(f"{spec.meta.name}: index {index} is outside dim {dim} of size {shape[dim]}")
    cutting = [m for m, _ in _cutting(layout, dim)]
    owner, position = None, None
    for coord in _cutting_coords(layout, dim):
        pos = 0
        for a, b in layout.dim_intervals_at(shape, coord)[dim]:
            if a <= index < b:
                owner, position = tuple(coord[m] for m in cutting), pos + index - a
            pos += b - a
    kept = [m for m in range(len(layout.mesh.shape)) if m not in cutting]
    ranks = [layout.mesh.rank_at(c) for c in layout.mesh.coords() if tuple(c[m] for m in cutting) == owner]
    placements = tuple(
        replace(p, dim=p.dim - (p.dim > dim)) if isinstance(p, Shard) else p
        for m, p in enumerate(layout.placements)
        if m in kept
    )
    mesh_shape = tuple(layout.mesh.shape[m] for m in kept)
    if not mesh_shape:
        mesh_shape, placements = (1,), (Replicate(),)
    new_layout = Layout(Mesh(tuple(ranks), mesh_shape), placements)
    meta = TensorMeta(name, shape[:dim] + shape[dim + 1 :], spec.meta.dtype)
    if rank not in ranks:
        return None
    tensor = _local(spec, name).select(dim, position) if spec.tensor is not None else None
    return TensorSpec(meta, new_layout, tensor)


def regroup(
    spec: TensorSpec,
    dim: int,
    block: int,
    start: int,
    size: int,
    name: str,
    rank: int,
    *,
    pairs_of: int = 0,
    gated_heads: int = 0,
) -> TensorSpec:
    """Dim ``dim`` is blocks of ``block`` indices; keep ``[start, start + size)`` of each.

    When every rank holds whole blocks (Megatron's TP ≤ query groups) the logical tensor is sharded
    like the physical one with each block shrunk to ``size``. When each rank holds part of one block
    (TP > query groups: Megatron splits the fused rows evenly) each rank keeps what of the stretch
    it holds, an uneven ``Shard(dim, sizes=…)`` in which some ranks hold nothing.

    ``pairs_of=h``: the stretch is heads of ``h`` indices stored as adjacent rotary pairs
    (Megatron's ``rotary_interleaved``); logically each head is its pairs' first elements, then
    their second ones (HF's ``rotate_half``). The local tensor is then a permuted view.

    ``gated_heads=h``: the stretch is the query heads of ``h`` indices, then as many output-gate
    heads (Megatron's ``attention_output_gate``); logically each head's query is followed by its
    gate (Qwen3-Next's ``q_proj``). Ranks must hold whole blocks.
    """
    shape = tuple(spec.meta.shape)
    if shape[dim] % block or not 0 <= start <= start + size <= block:
        raise FormatError(
            f"{spec.meta.name}: dim {dim} of size {shape[dim]} is not blocks of {block} "
            f"holding [{start}, {start + size})"
        )
    if pairs_of and (size % pairs_of or pairs_of % 2):
        raise FormatError(f"{spec.meta.name}: {size} indices are not whole heads of {pairs_of} rotary pairs")
    logical_shape = shape[:dim] + (shape[dim] // block * size,) + shape[dim + 1 :]
    meta = TensorMeta(name, logical_shape, spec.meta.dtype)
    if _whole_blocks(spec, dim, block):
        layout = _scaled_layout(spec, dim, block, size)
        _check_blocks(spec, layout, dim, block, size, logical_shape)
        if spec.tensor is None:
            return TensorSpec(meta, layout, None)
        local = _local(spec, name)
        blocks = local.shape[dim] // block
        base = local.unflatten(dim, (blocks, block)).narrow(dim + 1, start, size)
        if pairs_of:
            return TensorSpec(meta, layout, _halves(base, dim + 1, pairs_of, lead=1))
        if gated_heads:
            return TensorSpec(meta, layout, _gated(base, dim, gated_heads))
        if blocks <= 1 or size == block:
            return TensorSpec(meta, layout, base.flatten(dim, dim + 1))
        groups = [(n,) for n in local.shape]
        groups[dim] = (blocks, size)
        return TensorSpec(meta, layout, SplitView(base, groups))
    if gated_heads:
        raise FormatError(
            f"{spec.meta.name}: a rank holding part of a query group (TP > query groups) "
            "splits its gated heads; keep TP ≤ num_query_groups"
        )
    layout, kept = _partial_blocks(spec, dim, block, start, size, rank, pairs_of)
    if spec.tensor is None or kept is None:
        return TensorSpec(meta, layout, None)
    local = _local(spec, name).narrow(dim, *kept)
    return TensorSpec(meta, layout, _halves(local, dim, pairs_of) if pairs_of and kept[1] else local)


def halves(spec: TensorSpec, dim: int, head: int, name: str) -> TensorSpec:
    """``spec`` whose dim ``dim`` is heads of ``head`` indices stored as adjacent rotary pairs,
    seen with each head's pairs split into halves (see ``regroup``); ``dim`` must not be sharded."""
    if _cutting(spec.layout, dim) or spec.meta.shape[dim] % head or head % 2:
        raise FormatError(f"{spec.meta.name}: dim {dim} is not whole, unsharded heads of {head} rotary pairs")
    meta = TensorMeta(name, tuple(spec.meta.shape), spec.meta.dtype)
    tensor = _halves(_local(spec, name), dim, head) if spec.tensor is not None else None
    return TensorSpec(meta, spec.layout, tensor)


def every(spec: TensorSpec, dim: int, start: int, step: int, name: str) -> TensorSpec:
    """Every ``step``-th index of dim ``dim`` of ``spec`` from ``start``: one of ``step`` logical
    tensors interleaved along it (a strided view); ``dim`` must not be sharded."""
    if _cutting(spec.layout, dim) or spec.meta.shape[dim] % step or not 0 <= start < step:
        raise FormatError(f"{spec.meta.name}: dim {dim} is not {step} unsharded tensors interleaved")
    shape = tuple(n // step if d == dim else n for d, n in enumerate(spec.meta.shape))
    tensor = None
    if spec.tensor is not None:
        local = _local(spec, name)
        index = [slice(None)] * local.dim()
        index[dim] = slice(start, None, step)
        tensor = local[tuple(index)]
    return TensorSpec(TensorMeta(name, shape, spec.meta.dtype), spec.layout, tensor)


def components(spec: TensorSpec, dim: int, sizes: Sequence[int], name: str) -> TensorSpec:
    """``spec`` whose dim ``dim`` is components of ``sizes``, each split over the ranks that shard it
    (rank r holds its chunk of every component, in order); the shards are marked so."""
    sizes = tuple(int(n) for n in sizes)
    cutting = _cutting(spec.layout, dim)
    if sum(sizes) != spec.meta.shape[dim] or any(p.stride != 1 or p.components for _, p in cutting):
        raise FormatError(f"{spec.meta.name}: dim {dim} is not components {sizes} sharded as {spec.layout}")
    placements = tuple(Shard(dim, components=sizes) if isinstance(p, Shard) and p.dim == dim else p
                       for p in spec.layout.placements)  # fmt: skip
    tensor = _local(spec, name) if spec.tensor is not None else None
    meta = TensorMeta(name, tuple(spec.meta.shape), spec.meta.dtype)
    return TensorSpec(meta, Layout(spec.layout.mesh, placements), tensor)


def assembled(
    spec: TensorSpec,
    name: str,
    shape: tuple[int, ...],
    parts: Sequence[tuple[int, int, int]] = (),
    *,
    offset: float = 0.0,
) -> TensorSpec:
    """Logical tensor ``name`` of global ``shape``, sharded along dim 0 as ``spec`` is (evenly, by
    the same ranks), whose local tensor is assembled from stretches of ``spec``'s: ``parts`` are
    ``(start in the logical local tensor, start in the physical one, rows)`` (none: the whole of
    it); it holds the stored values plus ``offset`` (``views.PiecewiseView``)."""
    layout, cutting, width = spec.layout, _cutting(spec.layout, 0), ways(spec, 0)
    if any(p.stride != 1 or p.components or p.sizes for _, p in cutting) or shape[0] % width:
        raise FormatError(f"{spec.meta.name}: {name} {shape} cannot be sharded as {layout}")
    meta = TensorMeta(name, tuple(shape), spec.meta.dtype)
    if spec.tensor is None:
        return TensorSpec(meta, layout, None)
    local = _local(spec, name)
    parts = parts or ((0, 0, local.shape[0]),)
    view = PiecewiseView([(at, local.narrow(0, start, rows)) for at, start, rows in parts], 0, offset)
    if tuple(view.shape) != (shape[0] // width, *shape[1:]):
        raise FormatError(f"{spec.meta.name}: its parts make {tuple(view.shape)} of {name} {shape}")
    return TensorSpec(meta, layout, view)


def _halves(t: torch.Tensor, dim: int, head: int, lead: int = 0) -> SplitView:
    """``t`` whose dim ``dim`` is whole heads of ``head`` pairs-adjacent indices, as the view whose
    logical dim (base dims ``dim - lead … dim``) lists per head the pairs' first elements, then their
    second ones."""
    heads = t.shape[dim] // head
    base = t.unflatten(dim, (heads, head // 2, 2)).transpose(dim + 1, dim + 2)
    groups = [(n,) for n in t.shape[: dim - lead]]
    groups.append((*t.shape[dim - lead : dim], heads, 2, head // 2))
    groups += [(n,) for n in t.shape[dim + 1 :]]
    return SplitView(base, groups)


def _gated(base: torch.Tensor, dim: int, head: int) -> SplitView:
    """``base`` of dims ``(blocks, [q heads; gate heads])`` at ``dim``, as the view listing per block
    each head's query rows, then its gate's."""
    blocks, rows = base.shape[dim], base.shape[dim + 1]
    heads = rows // (2 * head)
    view = base.unflatten(dim + 1, (2, heads, head)).transpose(dim + 1, dim + 2)
    groups = [(n,) for n in base.shape[:dim]] + [(blocks, heads, 2, head)]
    return SplitView(view, groups + [(n,) for n in base.shape[dim + 2 :]])


def _whole_blocks(spec: TensorSpec, dim: int, block: int) -> bool:
    return all(
        not (a % block or b % block)
        for coord in _cutting_coords(spec.layout, dim)
        for a, b in spec.layout.dim_intervals_at(tuple(spec.meta.shape), coord)[dim]
    )


def _partial_blocks(
    spec: TensorSpec, dim: int, block: int, start: int, size: int, rank: int, pairs_of: int
) -> tuple[Layout, tuple[int, int] | None]:
    """The logical layout when each rank holds one stretch of one block, and ``(local start, rows)``
    of this rank's part of the kept stretch (None when ``rank`` is outside the layout)."""
    cutting = _cutting(spec.layout, dim)
    if len(cutting) != 1 or cutting[0][1].stride != 1 or cutting[0][1].components:
        raise FormatError(f"{spec.meta.name}: blocks of {block} cannot be taken out of {spec.layout}")
    m, _ = cutting[0]
    sizes, mine = [], None
    coord_of_rank = spec.layout.mesh.coord_of(rank)
    for coord in _cutting_coords(spec.layout, dim):
        held = [
            iv for iv in spec.layout.dim_intervals_at(tuple(spec.meta.shape), coord)[dim] if iv[1] > iv[0]
        ]
        a, b = held[0] if len(held) == 1 else (0, 0)
        if len(held) > 1 or (b > a and a // block != (b - 1) // block):
            raise FormatError(
                f"{spec.meta.name}: rank {spec.layout.mesh.rank_at(coord)} holds {held} along dim {dim}: "
                f"neither whole blocks of {block} nor part of one"
            )
        first = a // block * block + start
        lo, hi = max(a, first), min(b, first + size)
        lo, hi = (lo, hi) if hi > lo else (a, a)
        if pairs_of and ((lo - first) % pairs_of or (hi - lo) % pairs_of):
            raise FormatError(
                f"{spec.meta.name}: rank {spec.layout.mesh.rank_at(coord)} holds part of a head, whose "
                f"rotary pairs (rotary_interleaved) cannot be regrouped on that rank alone"
            )
        expected_start = sum(sizes)
        if hi > lo and a // block * size + lo - first != expected_start:
            raise FormatError(f"{spec.meta.name}: blocks of {block} cannot be re-sharded as {spec.layout}")
        sizes.append(hi - lo)
        if coord_of_rank is not None and coord[m] == coord_of_rank[m]:
            mine = (lo - a, hi - lo)
    placements = tuple(
        Shard(dim, sizes=tuple(sizes)) if i == m else p for i, p in enumerate(spec.layout.placements)
    )
    return Layout(spec.layout.mesh, placements), mine


def _scaled_layout(spec: TensorSpec, dim: int, block: int, size: int) -> Layout:
    placements = []
    for p in spec.layout.placements:
        if isinstance(p, Shard) and p.dim == dim:
            if p.stride != 1 or p.components:
                raise FormatError(f"{spec.meta.name}: cannot take blocks out of a {p!r} shard")
            if p.sizes:
                if any(n % block for n in p.sizes):
                    raise FormatError(f"{spec.meta.name}: {p!r} splits blocks of {block}")
                p = replace(p, sizes=tuple(n // block * size for n in p.sizes))
        placements.append(p)
    return Layout(spec.layout.mesh, tuple(placements))


def _check_blocks(
    spec: TensorSpec, layout: Layout, dim: int, block: int, size: int, logical_shape: tuple[int, ...]
) -> None:
    """Every rank holds whole blocks, and the logical layout gives it exactly those blocks."""
    physical = spec.layout
    for coord in _cutting_coords(physical, dim):
        held = physical.dim_intervals_at(tuple(spec.meta.shape), coord)[dim]
        if any(a % block or b % block for a, b in held):
            rank = physical.mesh.rank_at(coord)
            raise FormatError(
                f"{spec.meta.name}: rank {rank} holds {list(held)} along dim {dim}, "
                f"not whole blocks of {block}"
            )
        expected = tuple((a // block * size, b // block * size) for a, b in held if b > a)
        got = tuple(iv for iv in layout.dim_intervals_at(logical_shape, coord)[dim] if iv[1] > iv[0])
        if _merged(expected) != _merged(got):
            raise FormatError(f"{spec.meta.name}: blocks of {block} cannot be re-sharded as {layout}")


def unpad(
    spec: TensorSpec, dim: int, size: int, name: str, rank: int
) -> tuple[TensorSpec, torch.Tensor | None]:
    """The first ``size`` indices of padded dim ``dim`` are the logical tensor; the rest is padding.

    Returns the logical spec and this rank's local padding view (None when it holds none). A plain
    ``Shard(dim)`` over W ranks of a padded extent divisible by W becomes ``Shard(dim, sizes=…)``.
    """
    shape = tuple(spec.meta.shape)
    padded = shape[dim]
    if not 0 <= size <= padded:
        raise FormatError(f"{spec.meta.name}: {size} real indices out of a padded dim of {padded}")
    cutting = _cutting(spec.layout, dim)
    coord = spec.layout.mesh.coord_of(rank)
    placements = list(spec.layout.placements)
    if not cutting:
        keep = size
    elif len(cutting) == 1 and not (cutting[0][1].stride != 1 or cutting[0][1].components):
        m, shard = cutting[0]
        width = spec.layout.mesh.shape[m]
        held = shard.sizes or tuple(b - a for a, b in (chunk_bounds(padded, width, i) for i in range(width)))
        starts = [sum(held[:i]) for i in range(width)]
        real = tuple(max(0, min(n, size - s)) for n, s in zip(held, starts, strict=True))
        placements[m] = Shard(dim, sizes=real)
        keep = real[coord[m]] if coord is not None else 0
    else:
        raise FormatError(f"{spec.meta.name}: cannot drop the padding of dim {dim} sharded as {spec.layout}")
    meta = TensorMeta(name, shape[:dim] + (size,) + shape[dim + 1 :], spec.meta.dtype)
    layout = Layout(spec.layout.mesh, tuple(placements))
    if spec.tensor is None:
        return TensorSpec(meta, layout, None), None
    local = _local(spec, name)
    pad = local.narrow(dim, keep, local.shape[dim] - keep)
    return TensorSpec(meta, layout, local.narrow(dim, 0, keep)), (pad if pad.numel() else None)


def ways(spec: TensorSpec, dim: int) -> int:
    """Into how many shards the ranks cut dim ``dim`` of ``spec``."""
    return math.prod(spec.layout.mesh.shape[m] for m, _ in _cutting(spec.layout, dim))


def _local(spec: TensorSpec, name: str) -> torch.Tensor:
    if not isinstance(spec.tensor, torch.Tensor):
        raise FormatError(f"{name}: the local tensor of {spec.meta.name} is a {type(spec.tensor).__name__}")
    return spec.tensor


def _cutting(layout: Layout, dim: int) -> list[tuple[int, Shard]]:
    """``(mesh dim, placement)`` of every mesh dim that shards tensor dim ``dim``."""
    return [(m, p) for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]


def _cutting_coords(layout: Layout, dim: int):
    """One mesh coordinate per combination of the mesh dims sharding ``dim`` (others at 0)."""
    cutting = [m for m, _ in _cutting(layout, dim)]
    for sub in product(*(range(layout.mesh.shape[m]) for m in cutting)):
        coord = [0] * len(layout.mesh.shape)
        for m, c in zip(cutting, sub, strict=True):
            coord[m] = c
        yield tuple(coord)


def _merged(intervals) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)
