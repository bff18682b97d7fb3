"""Local tensors that are not one strided view: ``SplitView`` and the regions cut from it.

A format maps a physical parameter onto logical tensors by views: ``narrow`` (a fused part),
``select`` (one expert of a stacked tensor), ``permute`` (a transposed weight). One mapping needs
more: Megatron's ``linear_qkv`` holds, per query group, ``[q heads; k; v]``, so a rank's piece of
``q_proj`` is ``g`` blocks of ``p·h`` rows with ``2h`` rows between them. That is a strided view of
shape ``(g, p·h, H)`` whose first two dims *flatten* to the logical rows; ``torch`` cannot view it
as ``(g·p·h, H)``. ``SplitView`` is that view with the grouping, and ``region()`` cuts a logical
box out of it as a ``SplitRegion``: the few boxes of the base view it covers (a row range over
``(g, p·h)`` is at most a head, a body and a tail block), each with where it sits in the region.

The executor copies with ``copy_into``/``materialize``, which take plain tensors and split regions
alike. A region in row-major order is the same bytes whichever side splits it, so sender and
receiver still agree on a message's layout without knowing each other's grouping.

``PiecewiseView`` is the other local tensor no strided view can be: one assembled along a dim from
stretches of a parameter that are not evenly spaced (Megatron's Qwen3-Next ``in_proj`` holds a
rank's ``[Q; K; V; Z; B; A]``, where HF's ``in_proj_qkvz`` interleaves them per key head), or a
parameter stored with a constant ``offset`` (a zero-centred norm weight kept as ``w - 1``).
``storage_views`` lists the plain views under any of them (to find the parameter they write).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Block = tuple[tuple[int, int], ...]
"""One box of a group of base dims: per base dim ``(start, stop)``."""


def flat_blocks(sizes: Sequence[int], start: int, stop: int) -> list[tuple[int, Block]]:
    """Cut the row-major index range ``[start, stop)`` over dims ``sizes`` into boxes.

    Returns ``(offset of the block inside the range, block)`` in order; each block is a box of the
    base dims whose row-major order is a contiguous stretch of the range (so a range of the
    flattened dim reads as the blocks one after another). At most ``2·len(sizes) - 1`` blocks.
    """
    if start >= stop:
        return []
    if len(sizes) == 1:
        return [(0, ((start, stop),))]
    inner = math.prod(sizes[1:])
    first, r0 = divmod(start, inner)
    last, r1 = divmod(stop, inner)
    full = tuple((0, n) for n in sizes[1:])
    if first == last:
        return [(off, ((first, first + 1), *b)) for off, b in flat_blocks(sizes[1:], r0, r1)]
    out: list[tuple[int, Block]] = []
    at = 0
    if r0:
        for off, b in flat_blocks(sizes[1:], r0, inner):
            out.append((off, ((first, first + 1), *b)))
        at, first = inner - r0, first + 1
    if first < last:
        out.append((at, ((first, last), *full)))
        at += (last - first) * inner
    if r1:
        for off, b in flat_blocks(sizes[1:], 0, r1):
            out.append((at + off, ((last, last + 1), *b)))
    return out


@dataclass(frozen=True)
class SplitRegion:
    """A logical box of a ``SplitView``: ``pieces`` are ``(slices into the region, base view)``.

    Each base view's dims split the region's dims (per logical dim, the block's extents), so the
    matching part of any tensor of the region's shape is ``part.view(base_view.shape)``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    pieces: tuple[tuple[tuple[slice, ...], torch.Tensor], ...]
    offset: float = 0.0
    """The region's values are its pieces' plus ``offset`` (computed in the pieces' dtype)."""

    def is_contiguous(self) -> bool:
        return False

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)


class SplitView:
    """A local tensor whose logical dim ``i`` is the row-major flattening of base dims ``groups[i]``.

    ``base`` is a strided view (usually of a parameter); ``groups[i]`` are the sizes of the base
    dims making logical dim ``i`` (consecutive, in order). ``shape``/``dtype``/``device``/``dim()``
    answer as the logical tensor would. Writes through ``region()`` land in ``base``'s storage.
    """

    def __init__(self, base: torch.Tensor, groups: Sequence[Sequence[int]]) -> None:
        self.groups = tuple(tuple(int(n) for n in g) for g in groups)
        flat = tuple(n for g in self.groups for n in g)
        if tuple(base.shape) != flat:
            raise ValueError(f"SplitView: base shape {tuple(base.shape)} is not the groups {self.groups}")
        self.base = base
        self.shape = torch.Size(math.prod(g) for g in self.groups)
        self.dtype = base.dtype
        self.device = base.device

    def dim(self) -> int:
        return len(self.groups)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"SplitView(shape={tuple(self.shape)}, groups={self.groups}, dtype={self.dtype})"

    def region(self, offsets: Sequence[int], sizes: Sequence[int]) -> SplitRegion | torch.Tensor:
        """The box at ``offsets`` of extent ``sizes``: a plain view when it is one base block."""
        per_dim = [flat_blocks(g, o, o + s) for g, o, s in zip(self.groups, offsets, sizes, strict=True)]
        pieces = []
        for combo in _product(per_dim):
            slices, index = [], []
            for (off, block), size in zip(combo, (_numel(b) for _, b in combo), strict=True):
                slices.append(slice(off, off + size))
                index.extend(slice(a, b) for a, b in block)
            pieces.append((tuple(slices), self.base[tuple(index)]))
        shape = tuple(int(s) for s in sizes)
        if len(pieces) == 1:
            view = pieces[0][1]
            return (
                view.view(shape)
                if _viewable(view, shape)
                else SplitRegion(shape, self.dtype, self.device, tuple(pieces))
            )
        return SplitRegion(shape, self.dtype, self.device, tuple(pieces))


def _numel(block: Block) -> int:
    return math.prod(b - a for a, b in block)


def _product(per_dim: list[list[tuple[int, Block]]]):
    combos: list[list[tuple[int, Block]]] = [[]]
    for options in per_dim:
        combos = [c + [o] for c in combos for o in options]
    return combos


def _viewable(view: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        view.view(shape)
    except RuntimeError:
        return False
    return True


class PiecewiseView:
    """A local tensor made of plain views laid one after another along dim ``dim``, holding their
    values plus ``offset``: ``parts`` are ``(start along dim, view)``, covering ``[0, shape[dim])``.

    Reading a region gives the parts' values + ``offset`` (in their dtype), writing one stores the
    written values - ``offset`` (cast first); both are exact for a norm weight in [0.5, 2] with
    ``offset`` 1. Writes through ``region()`` land in the parts' storage.
    """

    def __init__(self, parts: Sequence[tuple[int, torch.Tensor]], dim: int = 0, offset: float = 0.0) -> None:
        self.parts = tuple(sorted(((int(a), v) for a, v in parts), key=lambda p: p[0]))
        first = self.parts[0][1]
        at = 0
        for start, view in self.parts:
            rest = tuple(n for d, n in enumerate(view.shape) if d != dim)
            if start != at or rest != tuple(n for d, n in enumerate(first.shape) if d != dim):
                raise ValueError(f"PiecewiseView: parts {[(a, tuple(v.shape)) for a, v in self.parts]} "
                                 f"do not tile dim {dim}")  # fmt: skip
            at += view.shape[dim]
        self.dim_, self.offset = dim, float(offset)
        self.shape = torch.Size(at if d == dim else n for d, n in enumerate(first.shape))
        self.dtype, self.device = first.dtype, first.device

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"PiecewiseView(shape={tuple(self.shape)}, parts={len(self.parts)}, offset={self.offset})"

    def region(self, offsets: Sequence[int], sizes: Sequence[int]) -> SplitRegion | torch.Tensor:
        """The box at ``offsets`` of extent ``sizes``: a plain view when it lies in one part and
        there is no offset."""
        d, lo, hi = self.dim_, offsets[self.dim_], offsets[self.dim_] + sizes[self.dim_]
        pieces = []
        for start, view in self.parts:
            a, b = max(lo, start), min(hi, start + view.shape[d])
            if a >= b:
                continue
            index = [slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)]
            index[d] = slice(a - start, b - start)
            slices = [slice(0, s) for s in sizes]
            slices[d] = slice(a - lo, b - lo)
            pieces.append((tuple(slices), view[tuple(index)]))
        if len(pieces) == 1 and not self.offset:
            return pieces[0][1]
        return SplitRegion(tuple(int(s) for s in sizes), self.dtype, self.device, tuple(pieces), self.offset)


def storage_views(tensor: object) -> list[torch.Tensor]:
    """The plain views a local tensor reads and writes (its parts, a split view's base, itself)."""
    if isinstance(tensor, PiecewiseView):
        return [view for _, view in tensor.parts]
    if isinstance(tensor, SplitView):
        return [tensor.base]
    return [tensor] if isinstance(tensor, torch.Tensor) else []


Region = torch.Tensor | SplitRegion


def region(
    tensor: torch.Tensor | SplitView | PiecewiseView, offsets: Sequence[int], sizes: Sequence[int]
) -> Region:
    """The view of ``tensor`` starting at local ``offsets`` with extent ``sizes`` (no copy)."""
    if isinstance(tensor, (SplitView, PiecewiseView)):
        return tensor.region(offsets, sizes)
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def copy_into(dst: Region, src: Region) -> None:
    """``dst.copy_(src)`` for plain tensors and split regions of one shape (dtype cast as ``copy_``);
    a region's ``offset`` is added when it is read and subtracted when it is written."""
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, SplitRegion) and isinstance(src, torch.Tensor):
        for slices, view in dst.pieces:
            view.copy_(src[slices].view(view.shape))
            if dst.offset:
                view.sub_(dst.offset)
    elif isinstance(src, SplitRegion) and isinstance(dst, torch.Tensor):
        for slices, view in src.pieces:
            dst[slices].view(view.shape).copy_(view + src.offset if src.offset else view)
    else:  # two groupings that need not line up: through one contiguous copy
        copy_into(dst, materialize(src))


def materialize(src: Region) -> torch.Tensor:
    """``src`` as a tensor (itself when it is one; a fresh contiguous copy of a split region)."""
    if isinstance(src, torch.Tensor):
        return src
    out = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    copy_into(out, src)
    return out
