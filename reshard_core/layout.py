"""How a logical tensor is spread over ranks: meshes, placements, and the boxes a rank holds.

Everything here is pure Python (no process group, no torch): a layout plus a rank gives that rank's
holding as per-dimension interval lists, and from those, boxes (global offsets and sizes paired with
the offsets of the same region inside the rank's local tensor).

Placements are applied left to right over the mesh dims, each one cutting the *current local
extent* of its tensor dim (DTensor's convention). Cutting follows ``torch.chunk``: chunk size
``ceil(L / n)``, so uneven and empty trailing shards exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

Interval = tuple[int, int]
"""A half-open global index range ``[start, stop)`` along one tensor dim."""


@dataclass(frozen=True)
class Replicate:
    """Every rank along this mesh dim holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over this mesh dim.

    - ``stride == 1`` and no ``components``: ``torch.chunk`` into W pieces, rank r takes piece r.
    - ``stride == s > 1`` (Megatron ``partition_stride``, DTensor ``_StridedShard(split_factor=s)``):
      cut into W·s chunks; rank r holds chunks r, r+W, …, r+(s-1)W, concatenated in that order.
    - ``components = (c0, c1, …)`` (Megatron ``partition_sizes`` times W): the extent is a packing of
      independent parts of full sizes c_i, each chunked over W on its own; rank r holds its piece of
      every part, concatenated.
    - ``sizes = (n0, n1, …, n_{W-1})``: an explicit, possibly uneven split; rank r holds the ``n_r``
      indices after ``n0 + … + n_{r-1}``. It expresses splits ``torch.chunk`` cannot: a vocab padded
      to ``W·b`` rows of which only the first V are real (``(b, b, …, V - k·b, 0, …)``), or vLLM's
      "linear" expert placement (``b + 1`` for the first ``E % W`` ranks, ``b`` after).
    """

    dim: int
    stride: int = 1
    components: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard dim must be >= 0, got {self.dim}")
        if self.stride < 1:
            raise ValueError(f"Shard stride must be >= 1, got {self.stride}")
        if sum(bool(x) for x in (self.stride != 1, self.components, self.sizes)) > 1:
            raise ValueError("Shard takes one of stride, components or sizes")
        if any(n < 0 for n in self.sizes):
            raise ValueError(f"Shard sizes must be >= 0, got {self.sizes}")

    def __repr__(self) -> str:
        extra = f", stride={self.stride}" if self.stride != 1 else ""
        extra += f", components={self.components}" if self.components else ""
        extra += f", sizes={self.sizes}" if self.sizes else ""
        return f"Shard({self.dim}{extra})"


Placement = Replicate | Shard


def chunk_bounds(length: int, pieces: int, index: int) -> Interval:
    """Bounds of piece ``index`` when ``torch.chunk`` cuts ``length`` into ``pieces``."""
    size = -(-length // pieces) if length else 0
    return min(length, index * size), min(length, (index + 1) * size)


@dataclass(frozen=True)
class Mesh:
    """An ordered tuple of global ranks viewed as an n-d grid (row-major)."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if math.prod(self.shape) != len(self.ranks):
            raise ValueError(f"mesh shape {self.shape} does not fit {len(self.ranks)} ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh ranks repeat: {self.ranks}")

    @classmethod
    def of(cls, ranks, shape=None) -> Mesh:
        ranks = tuple(int(r) for r in ranks)
        return cls(ranks, tuple(shape) if shape is not None else (len(ranks),))

    def coord_of(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of ``rank``, or None when the rank is not in the mesh."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        coord = []
        for size in reversed(self.shape):
            coord.append(flat % size)
            flat //= size
        return tuple(reversed(coord))

    def rank_at(self, coord: tuple[int, ...]) -> int:
        flat = 0
        for c, size in zip(coord, self.shape, strict=True):
            flat = flat * size + c
        return self.ranks[flat]

    def coords(self):
        """All coordinates in row-major order."""
        return product(*(range(s) for s in self.shape))


@dataclass(frozen=True)
class Box:
    """A rectangular region: global ``offsets``/``sizes`` and where it starts in the local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def take_intervals(intervals: tuple[Interval, ...], start: int, stop: int) -> list[Interval]:
    """Global intervals behind local positions ``[start, stop)`` of a concatenation of intervals.

    ``intervals`` is one dim of a rank's holding (``Layout.dim_intervals``), in local order.
    """
    out: list[Interval] = []
    pos = 0
    for a, b in intervals:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += n
        if pos >= stop:
            break
    return out


def _cut(intervals: tuple[Interval, ...], shard: Shard, world: int, index: int) -> tuple[Interval, ...]:
    length = sum(b - a for a, b in intervals)
    pieces: list[Interval] = []
    if shard.sizes:
        if len(shard.sizes) != world:
            raise ValueError(f"{shard!r}: {len(shard.sizes)} sizes for a mesh dim of {world} ranks")
        if sum(shard.sizes) != length:
            raise ValueError(f"{shard!r}: sizes sum to {sum(shard.sizes)}, extent is {length}")
        start = sum(shard.sizes[:index])
        pieces.append((start, start + shard.sizes[index]))
    elif shard.components:
        if sum(shard.components) != length:
            raise ValueError(f"{shard!r}: components sum to {sum(shard.components)}, extent is {length}")
        base = 0
        for comp in shard.components:
            a, b = chunk_bounds(comp, world, index)
            pieces.append((base + a, base + b))
            base += comp
    else:
        for k in range(shard.stride):
            pieces.append(chunk_bounds(length, world * shard.stride, index + k * world))
    out: list[Interval] = []
    for a, b in pieces:
        for iv in take_intervals(intervals, a, b):
            if out and out[-1][1] == iv[0]:  # merge adjacent pieces so boxes stay few
                out[-1] = (out[-1][0], iv[1])
            else:
                out.append(iv)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """A mesh plus one placement per mesh dim."""

    mesh: Mesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.mesh.shape):
            raise ValueError(
                f"layout has {len(self.placements)} placements for a {len(self.mesh.shape)}-d mesh"
            )

    @classmethod
    def replicated(cls, ranks) -> Layout:
        return cls(Mesh.of(ranks), (Replicate(),))

    def dim_intervals_at(
        self, shape: tuple[int, ...], coord: tuple[int, ...]
    ) -> tuple[tuple[Interval, ...], ...]:
        """Per tensor dim, the global intervals the rank at ``coord`` holds, in local order."""
        dims: list[tuple[Interval, ...]] = [((0, n),) for n in shape]
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                if placement.dim >= len(shape):
                    raise ValueError(f"{placement!r} on a {len(shape)}-d tensor")
                dims[placement.dim] = _cut(
                    dims[placement.dim], placement, self.mesh.shape[mesh_dim], coord[mesh_dim]
                )
        return tuple(tuple(iv for iv in d if iv[1] > iv[0]) if len(d) > 1 else d for d in dims)

    def dim_intervals(self, shape: tuple[int, ...], rank: int) -> tuple[tuple[Interval, ...], ...] | None:
        coord = self.mesh.coord_of(rank)
        return None if coord is None else self.dim_intervals_at(shape, coord)

    def local_shape(self, shape: tuple[int, ...], rank: int) -> tuple[int, ...] | None:
        dims = self.dim_intervals(shape, rank)
        return None if dims is None else tuple(sum(b - a for a, b in d) for d in dims)

    def boxes(self, shape: tuple[int, ...], rank: int) -> tuple[Box, ...]:
        """The rank's holding as boxes (empty when the rank is not in the mesh or holds nothing)."""
        dims = self.dim_intervals(shape, rank)
        if dims is None:
            return ()
        per_dim: list[list[tuple[int, int, int]]] = []  # (global start, size, local start)
        for d in dims:
            pos, entries = 0, []
            for a, b in d:
                if b > a:
                    entries.append((a, b - a, pos))
                pos += b - a
            per_dim.append(entries)
        if shape == ():
            return (Box((), (), ()),)
        return tuple(
            Box(tuple(e[0] for e in combo), tuple(e[1] for e in combo), tuple(e[2] for e in combo))
            for combo in product(*per_dim)
        )
