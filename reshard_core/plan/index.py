"""Per-dimension interval indexes over layouts, so box lookups never scan ranks.

A layout's holding along tensor dim ``d`` depends only on the coordinates of the mesh dims whose
placement shards ``d`` (its *sharding dims* for ``d``). Enumerating those sub-coordinates once gives
the dim's **segments**: sorted global intervals, each owned by one sub-coordinate at a known local
offset. A rank's box is the product of its per-dim segments; the ranks holding a given piece are
found by bisecting each dim's segments and then varying the replicate mesh dims.

A side with several layouts (replica meshes) gets a **refined** index per dim: the common
refinement of all layouts' segment boundaries, each refined segment naming its owner in every
layout, so one piece is held whole by a known rank in each layout.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import product
from math import prod

from ..layout import Layout, Mesh, Shard


@dataclass(frozen=True)
class Segments:
    """Sorted non-empty intervals along one tensor dim: ``[starts[k], stops[k])`` is held by
    sub-coordinate ``subs[k]`` starting at local offset ``locals_[k]``."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]
    subs: tuple[int, ...]
    locals_: tuple[int, ...]

    def overlapping(self, start: int, stop: int) -> range:
        """Indexes of the segments that overlap ``[start, stop)`` (segments must not overlap)."""
        return range(bisect_right(self.stops, start), bisect_left(self.starts, stop))


class LayoutDims:
    """One layout viewed against one global shape: sharding dims, replicate dims, per-dim segments."""

    def __init__(self, layout: Layout, shape: tuple[int, ...]) -> None:
        mesh_shape = layout.mesh.shape
        self.layout = layout
        self.shape = shape
        self.shard_dims: tuple[tuple[int, ...], ...] = tuple(
            tuple(m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == d)
            for d in range(len(shape))
        )
        sharding = {m for dims in self.shard_dims for m in dims}
        self.rep_dims = tuple(m for m in range(len(mesh_shape)) if m not in sharding)
        self.rep_size = prod(mesh_shape[m] for m in self.rep_dims)
        # sub_coords[d][flat] = coordinates over shard_dims[d] (row-major)
        self.sub_coords = tuple(
            tuple(product(*(range(mesh_shape[m]) for m in dims))) for dims in self.shard_dims
        )
        self.segments = tuple(self._segments(d) for d in range(len(shape)))
        self.overlap = self._first_overlap()
        self.gaps = tuple((d, lo, hi) for d in range(len(shape)) for lo, hi in self._gaps(d))

    def _first_overlap(self) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the first place two segments overlap, or None."""
        for d, segs in enumerate(self.segments):
            for k in range(1, len(segs.starts)):
                if segs.starts[k] < segs.stops[k - 1]:
                    return d, segs.starts[k], min(segs.stops[k], segs.stops[k - 1])
        return None

    def _gaps(self, d: int) -> list[tuple[int, int]]:
        """Index ranges along dim ``d`` no segment holds."""
        segs, length = self.segments[d], self.shape[d]
        gaps, pos = [], 0
        for a, b in zip(segs.starts, segs.stops, strict=True):
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, b)
        if pos < length:
            gaps.append((pos, length))
        return gaps

    def _segments(self, d: int) -> Segments:
        rows = []
        coord = [0] * len(self.layout.mesh.shape)
        for flat, sub in enumerate(self.sub_coords[d]):
            for m, c in zip(self.shard_dims[d], sub, strict=True):
                coord[m] = c
            pos = 0
            for a, b in self.layout.dim_intervals_at(self.shape, tuple(coord))[d]:
                if b > a:
                    rows.append((a, b, flat, pos))
                pos += b - a
        rows.sort()
        if not rows:
            return Segments((), (), (), ())
        return Segments(*(tuple(col) for col in zip(*rows, strict=True)))

    def split_coord(self, coord: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """A mesh coordinate as (per tensor dim sub-coordinate flat index, replica index)."""
        mesh_shape = self.layout.mesh.shape
        subs = []
        for dims in self.shard_dims:
            flat = 0
            for m in dims:
                flat = flat * mesh_shape[m] + coord[m]
            subs.append(flat)
        rep = 0
        for m in self.rep_dims:
            rep = rep * mesh_shape[m] + coord[m]
        return tuple(subs), rep

    def coord_of(self, subs: tuple[int, ...], rep: int) -> tuple[int, ...]:
        """The mesh coordinate at per-dim sub-coordinates ``subs`` and replica index ``rep``."""
        mesh_shape = self.layout.mesh.shape
        coord = [0] * len(mesh_shape)
        for d, flat in enumerate(subs):
            for m, c in zip(self.shard_dims[d], self.sub_coords[d][flat], strict=True):
                coord[m] = c
        for m in reversed(self.rep_dims):
            rep, coord[m] = divmod(rep, mesh_shape[m])
        return tuple(coord)

    def rank_of(self, subs: tuple[int, ...], rep: int) -> int:
        """The rank at per-dim sub-coordinates ``subs`` and replica index ``rep``."""
        return self.layout.mesh.rank_at(self.coord_of(subs, rep))

    def replicas(self, subs: tuple[int, ...]) -> list[int]:
        """Every rank holding the sub-coordinates ``subs``, in replica order."""
        return [self.rank_of(subs, j) for j in range(self.rep_size)]


@dataclass(frozen=True)
class Refined:
    """Common refinement of several layouts' segments along one dim.

    ``owners[k][i]`` = (sub-coordinate, local offset at ``starts[k]``) of layout ``i``.
    """

    starts: tuple[int, ...]
    stops: tuple[int, ...]
    owners: tuple[tuple[tuple[int, int], ...], ...]

    def overlapping(self, start: int, stop: int) -> range:
        return range(bisect_right(self.stops, start), bisect_left(self.starts, stop))


def refine(per_layout: list[Segments]) -> Refined:
    """Refine segments of layouts that each tile the dim exactly (validated beforehand)."""
    if len(per_layout) == 1:
        s = per_layout[0]
        return Refined(s.starts, s.stops, tuple(((u, o),) for u, o in zip(s.subs, s.locals_, strict=True)))
    points = sorted({p for s in per_layout for p in (*s.starts, *s.stops)})
    starts, stops, owners = [], [], []
    for a, b in zip(points, points[1:], strict=False):
        row = []
        for s in per_layout:
            k = bisect_right(s.starts, a) - 1
            row.append((s.subs[k], s.locals_[k] + a - s.starts[k]))
        starts.append(a)
        stops.append(b)
        owners.append(tuple(row))
    return Refined(tuple(starts), tuple(stops), tuple(owners))


class SideIndex:
    """All layouts of one side of one tensor: membership, replica numbering, refined segments.

    Replica numbers run over the layouts in order: layout ``i``'s replica ``j`` is number
    ``offsets[i] + j``; ``total`` is the number of copies of every element on this side.
    """

    def __init__(self, dims: tuple[LayoutDims, ...], lookups: tuple[dict[int, int], ...]) -> None:
        self.dims = dims
        self._lookups = lookups
        offsets, total = [], 0
        for ld in dims:
            offsets.append(total)
            total += ld.rep_size
        self.offsets = tuple(offsets)
        self.total = total
        self._refined: tuple[Refined, ...] | None = None

    @property
    def refined(self) -> tuple[Refined, ...]:
        if self._refined is None:
            ndim = len(self.dims[0].shape) if self.dims else 0
            self._refined = tuple(refine([ld.segments[d] for ld in self.dims]) for d in range(ndim))
        return self._refined

    def member(self, rank: int) -> tuple[int, tuple[int, ...]] | None:
        """(layout index, mesh coordinate) of ``rank``, or None (first layout wins; validation
        rejects a rank in two layouts of one side)."""
        for i, lookup in enumerate(self._lookups):
            flat = lookup.get(rank)
            if flat is not None:
                coord = []
                for size in reversed(self.dims[i].layout.mesh.shape):
                    flat, c = divmod(flat, size)
                    coord.append(c)
                return i, tuple(reversed(coord))
        return None


class IndexCache:
    """Indexes derived from one table, keyed by object identity of its interned layouts and meshes."""

    def __init__(self) -> None:
        self._dims: dict[tuple[int, tuple[int, ...]], LayoutDims] = {}
        self._lookups: dict[int, dict[int, int]] = {}
        self._sides: dict[tuple[str, str], SideIndex] = {}
        self._keep: list[object] = []  # keep keyed objects alive so ids stay unique
        self.extra: dict[str, object] = {}  # other table-derived data (planner-private)

    def mesh_lookup(self, mesh: Mesh) -> dict[int, int]:
        found = self._lookups.get(id(mesh))
        if found is None:
            found = self._lookups[id(mesh)] = {r: i for i, r in enumerate(mesh.ranks)}
            self._keep.append(mesh)
        return found

    def layout_dims(self, layout: Layout, shape: tuple[int, ...]) -> LayoutDims:
        key = (id(layout), shape)
        found = self._dims.get(key)
        if found is None:
            found = self._dims[key] = LayoutDims(layout, shape)
            self._keep.append(layout)
        return found

    def side(self, name: str, side: str, layouts: tuple[Layout, ...], shape: tuple[int, ...]) -> SideIndex:
        key = (name, side)
        found = self._sides.get(key)
        if found is None:
            found = self._sides[key] = SideIndex(
                tuple(self.layout_dims(lay, shape) for lay in layouts),
                tuple(self.mesh_lookup(lay.mesh) for lay in layouts),
            )
        return found
