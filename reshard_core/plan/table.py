"""The layout table: for every logical tensor, its meta and the layouts that hold it on each side.

Built once per refit from the specs of every rank (directly, or from the compact exchange), it is
the only input of the planner. Several layouts on one side are replicas held by different meshes
(one per data-parallel replica, say); a ``Replicate`` mesh dim inside one layout is replication too.

Meshes and layouts are interned while building, so one ``Mesh`` object stands for every equal mesh;
planner caches key on object identity and stay valid for the table's lifetime.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError
from ..layout import Layout, Mesh
from ..specs import TensorMeta, TensorSpec
from .describe import format_meta, format_ranks

SIDES = ("src", "dst")


@dataclass(frozen=True)
class TableEntry:
    """One logical tensor: ``meta`` and the layouts holding it on the source and destination side.

    ``meta`` is the destination's meta when the tensor has a destination, else the source's.
    ``src_meta`` is set only when the source disagrees with ``meta`` (validation rejects that).
    ``src_name`` is set when the source data is another tensor's (explicit tied-embedding fallback).
    """

    meta: TensorMeta
    src: tuple[Layout, ...]
    dst: tuple[Layout, ...]
    src_meta: TensorMeta | None = None
    src_name: str | None = None

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def source_meta(self) -> TensorMeta:
        return self.src_meta if self.src_meta is not None else self.meta

    def layouts(self, side: str) -> tuple[Layout, ...]:
        return self.src if side == "src" else self.dst


@dataclass(frozen=True)
class LayoutTable(Mapping[str, TableEntry]):
    """An immutable mapping ``name -> TableEntry``, iterated in sorted-name (canonical) order.

    ``cache`` holds derived data (indexes, fingerprint, validation) that planners attach; it is not
    part of equality.
    """

    entries: tuple[TableEntry, ...]
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.entries, key=lambda e: e.name))
        object.__setattr__(self, "entries", ordered)
        object.__setattr__(self, "_by_name", {e.name: e for e in ordered})
        if len(self._by_name) != len(ordered):
            raise ValueError("a layout table holds each name once")

    def __getitem__(self, name: str) -> TableEntry:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return (e.name for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __hash__(self) -> int:
        return hash(self.entries)

    @classmethod
    def from_specs(
        cls, src: Mapping[int, Iterable[TensorSpec]], dst: Mapping[int, Iterable[TensorSpec]]
    ) -> LayoutTable:
        """Build the table from every rank's specs (``{rank: specs}`` per side)."""
        builder = TableBuilder()
        for side, per_rank in (("src", src), ("dst", dst)):
            for rank, specs in per_rank.items():
                for spec in specs:
                    builder.add(side, rank, spec.meta, spec.layout)
        return builder.build()


class TableBuilder:
    """Collects ``(side, contributing rank, meta, layout)`` records into a ``LayoutTable``.

    Equal layouts contributed by several ranks are kept once. One name with different shape or
    dtype on one side raises ``PlanError`` naming the tensor and the contributing ranks.
    """

    def __init__(self) -> None:
        self._meshes: dict[Mesh, Mesh] = {}
        self._layouts: dict[Layout, Layout] = {}
        self._by_id: dict[int, tuple[Layout, Layout]] = {}  # id(given) -> (given, interned)
        # (side, name) -> meta, {layout: None} (ordered set), {meta: [ranks]}
        self._meta: dict[tuple[str, str], TensorMeta] = {}
        self._held: dict[tuple[str, str], dict[Layout, None]] = {}
        self._contributors: dict[tuple[str, str], dict[TensorMeta, list[int]]] = {}

    def intern(self, layout: Layout) -> Layout:
        """The table's single object equal to ``layout`` (with an interned mesh)."""
        seen = self._by_id.get(id(layout))
        if seen is not None:
            return seen[1]
        found = self._layouts.get(layout)
        if found is None:
            mesh = self._meshes.setdefault(layout.mesh, layout.mesh)
            found = layout if mesh is layout.mesh else Layout(mesh, layout.placements)
            self._layouts[found] = found
        self._by_id[id(layout)] = (layout, found)  # holding ``layout`` keeps its id unique
        return found

    def add(self, side: str, rank: int, meta: TensorMeta, layout: Layout) -> None:
        if side not in SIDES:
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        key = (side, meta.name)
        by_meta = self._contributors.setdefault(key, {})
        by_meta.setdefault(meta, []).append(rank)
        self._meta.setdefault(key, meta)
        self._held.setdefault(key, {})[self.intern(layout)] = None

    def _check_meta(self, key: tuple[str, str]) -> None:
        by_meta = self._contributors[key]
        if len(by_meta) > 1:
            side = "source" if key[0] == "src" else "destination"
            parts = [f"{format_meta(m)} on ranks {format_ranks(r)}" for m, r in by_meta.items()]
            raise PlanError(f"{key[1]}: {side} ranks disagree on shape or dtype: " + " vs ".join(parts))

    def build(self) -> LayoutTable:
        names = sorted({name for _, name in self._meta})
        entries = []
        for name in names:
            for side in SIDES:
                if (side, name) in self._meta:
                    self._check_meta((side, name))
            src_meta = self._meta.get(("src", name))
            dst_meta = self._meta.get(("dst", name))
            meta = dst_meta or src_meta
            entries.append(
                TableEntry(
                    meta=meta,
                    src=_canonical(self._held.get(("src", name), ())),
                    dst=_canonical(self._held.get(("dst", name), ())),
                    src_meta=src_meta if src_meta is not None and src_meta != meta else None,
                )
            )
        return LayoutTable(tuple(entries))


def _canonical(layouts: Iterable[Layout]) -> tuple[Layout, ...]:
    """Layouts in an order independent of who contributed them first: replica numbering (and so
    the planner's replica choice) must be identical on every rank."""
    return tuple(sorted(layouts, key=lambda lay: (lay.mesh.ranks, lay.mesh.shape, repr(lay.placements))))
