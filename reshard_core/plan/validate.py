"""Validation of a layout table before any data moves (contract 2 of docs/design.md: no silent loss).

``validate_table(table, ignore=..., tied=...)`` returns the *effective* table the planner uses, or
raises one ``PlanError`` naming the tensor, the ranks and the region of the first problem (in
canonical order; one-sided names are all listed at once):

1. names on one side only (either side; every such name is listed, with a count);
2. source and destination disagree on global shape, or on dtype alone (every such tensor listed,
   with the hint to pass ``cast=True``);
3. a layout whose mesh/placements do not fit the shape;
4. a rank inside two layouts of one side (on the destination: an element written twice);
5. a layout whose shards overlap along a dim (double coverage), or source layouts that leave
   elements unheld (holes: destination elements no source rank holds).

Checks work on per-dim interval lists of each distinct (layout, shape), never on ranks × elements.

Opt-outs, both explicit:

- ``ignore``: ``fnmatch`` patterns; a matching tensor is dropped from both sides (never moved).
- ``tied``: ``{destination name: source name}``, or ``True`` for Megatron's
  ``{"output_layer.weight": "embedding.word_embeddings.weight"}``. Used only when the destination
  name has no source at all: its source data is then the named source tensor (shape and dtype must
  agree). A source-only ``output_layer.weight`` (source unties, destination ties) is not a tie:
  ignore it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..errors import PlanError
from .describe import dim_word, format_layout, format_meta, format_ranks, format_region
from .index import LayoutDims
from .planner_context import context_for
from .table import LayoutTable, TableEntry

MEGATRON_TIED = {"output_layer.weight": "embedding.word_embeddings.weight"}
"""The tie Megatron-Core applies when ``share_embeddings_and_output_weights`` is set."""

Tied = Mapping[str, str] | bool | None


def normalize_options(ignore: Sequence[str] = (), tied: Tied = None) -> tuple[tuple[str, ...], tuple]:
    """Hashable, canonical forms of the ``ignore`` and ``tied`` options (used in cache keys)."""
    if isinstance(ignore, str):
        ignore = (ignore,)
    ties = MEGATRON_TIED if tied is True else (tied or {})
    return tuple(sorted(set(ignore))), tuple(sorted(ties.items()))


def validate_table(
    table: LayoutTable, ignore: Sequence[str] = (), tied: Tied = None, cast: bool = False
) -> LayoutTable:
    """The effective table (ignored names dropped, ties applied), after every check passed.

    ``cast``: a source whose dtype alone differs from its destination's is accepted (the plan
    carries the destination dtype; the sender converts while packing)."""
    key = ("validated", *normalize_options(ignore, tied), cast)
    found = table.cache.get(key)
    if found is None:
        effective = _apply_options(table, key[1], dict(key[2]))
        _check(effective, cast)
        found = table.cache[key] = effective
    return found


def _apply_options(table: LayoutTable, ignore: tuple[str, ...], ties: dict[str, str]) -> LayoutTable:
    entries = [e for e in table.entries if not any(fnmatch.fnmatchcase(e.name, p) for p in ignore)]
    changed = len(entries) != len(table.entries)
    for n, e in enumerate(entries):
        if e.src or not e.dst or e.name not in ties:
            continue
        origin = table.get(ties[e.name])
        if origin is None or not origin.src:
            raise PlanError(
                f"{e.name}: on the destination only (ranks {format_ranks(_ranks(e.dst))}) and its tied "
                f"source {ties[e.name]} is not on the source side either"
            )
        src_meta = origin.source_meta
        same = (tuple(src_meta.shape), src_meta.dtype) == (tuple(e.meta.shape), e.meta.dtype)
        entries[n] = replace(e, src=origin.src, src_meta=None if same else src_meta, src_name=origin.name)
        changed = True
    return LayoutTable(tuple(entries)) if changed else table


def _ranks(layouts) -> list[int]:
    return [r for lay in layouts for r in lay.mesh.ranks]


def _check(table: LayoutTable, cast: bool = False) -> None:
    index = context_for(table).index
    checked: set[int] = set()  # LayoutDims already checked for overlaps (shared by many tensors)
    _check_one_sided(table.entries)
    _check_metas(table.entries, cast)
    for e in table.entries:
        src = [_layout_dims(index, e, "src", lay) for lay in e.src]
        dst = [_layout_dims(index, e, "dst", lay) for lay in e.dst]
        for side, dims in (("src", src), ("dst", dst)):
            if len(dims) > 1:
                _check_disjoint_meshes(e, side, dims)
            for ld in dims:
                if id(ld) not in checked:
                    _check_tiling(e, side, ld)
                    checked.add(id(ld))
        if any(ld.gaps for ld in src) and 0 not in e.meta.shape:
            _raise_hole(e, src, dst)


def _check_one_sided(entries: Sequence[TableEntry]) -> None:
    """One ``PlanError`` naming every tensor held on one side only (all of them, counted)."""
    src_only = [e for e in entries if not e.dst]
    dst_only = [e for e in entries if not e.src and e.dst]
    parts = []
    if len(src_only) == 1:
        e = src_only[0]
        parts.append(
            f"{e.name}: on the source only (ranks {format_ranks(_ranks(e.src))}), no destination "
            f"holds it; pass ignore=[{e.name!r}] to leave it out"
        )
    elif src_only:
        parts.append(f"{_listed(src_only, 'src')}; pass ignore= with their names to leave them out")
    if len(dst_only) == 1:
        e = dst_only[0]
        parts.append(
            f"{e.name}: on the destination only (ranks {format_ranks(_ranks(e.dst))}), no source holds "
            f"it; pass ignore=[{e.name!r}] to leave it out, or tied= to feed it from another tensor"
        )
    elif dst_only:
        parts.append(
            f"{_listed(dst_only, 'dst')}; pass ignore= with their names to leave them out, "
            "or tied= to feed them from other tensors"
        )
    if parts:
        raise PlanError("; ".join(parts))


def _listed(entries: Sequence[TableEntry], side: str) -> str:
    """``"3 tensors on the source only (ranks [0-3]), no destination holds them: a, b, c"``; the
    ranks go after each name when they differ between names."""
    word, other = ("source", "destination") if side == "src" else ("destination", "source")
    ranks = [format_ranks(_ranks(getattr(e, side))) for e in entries]
    if len(set(ranks)) == 1:
        where, names = f" (ranks {ranks[0]})", ", ".join(e.name for e in entries)
    else:
        where, names = "", ", ".join(f"{e.name} (ranks {r})" for e, r in zip(entries, ranks, strict=True))
    return f"{len(entries)} tensors on the {word} only{where}, no {other} holds them: {names}"


def _check_metas(entries: Sequence[TableEntry], cast: bool) -> None:
    """The first tensor whose source and destination shapes differ is a ``PlanError`` of its own;
    else, without ``cast``, one ``PlanError`` lists every tensor that differs in dtype alone."""
    for e in entries:
        if e.src_meta is not None and tuple(e.src_meta.shape) != tuple(e.meta.shape):
            tie = f" (tied to {e.src_name})" if e.src_name else ""
            raise PlanError(
                f"{e.name}: source{tie} {format_meta(e.src_meta)} on ranks {format_ranks(_ranks(e.src))} "
                f"but destination {format_meta(e.meta)} on ranks {format_ranks(_ranks(e.dst))}"
            )
    if cast:
        return
    by_pair: dict[tuple[str, str], list[TableEntry]] = {}
    for e in entries:
        if e.src_meta is not None:
            pair = (_dtype(e.src_meta.dtype), _dtype(e.meta.dtype))
            by_pair.setdefault(pair, []).append(e)
    parts = []
    for (src, dst), group in by_pair.items():
        if len(group) == 1:
            e = group[0]
            tie = f" (tied to {e.src_name})" if e.src_name else ""
            parts.append(
                f"{e.name}: source{tie} is {src} on ranks {format_ranks(_ranks(e.src))}, destination "
                f"{dst} on ranks {format_ranks(_ranks(e.dst))}; only the dtype differs (same shape "
                f"{tuple(e.meta.shape)})"
            )
        else:
            names = ", ".join(e.name for e in group)
            parts.append(
                f"{len(group)} tensors differ only in dtype, source {src} vs destination {dst}: {names}"
            )
    if parts:
        raise PlanError("; ".join(parts) + "; pass cast=True to convert on the way (the sender converts)")


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_dims(index, e: TableEntry, side: str, layout) -> LayoutDims:
    try:
        return index.layout_dims(layout, tuple(e.meta.shape))
    except (ValueError, IndexError) as err:
        raise PlanError(
            f"{e.name}: {_side_word(side)} layout {format_layout(layout)} does not fit "
            f"shape {tuple(e.meta.shape)}: {err} (ranks {format_ranks(layout.mesh.ranks)})"
        ) from None


def _side_word(side: str) -> str:
    return "source" if side == "src" else "destination"


def _check_disjoint_meshes(e: TableEntry, side: str, dims: list[LayoutDims]) -> None:
    seen: dict[int, int] = {}
    for i, ld in enumerate(dims):
        twice = [r for r in ld.layout.mesh.ranks if r in seen]
        if twice:
            first = dims[seen[twice[0]]]
            where = _overlap_text(e, first, ld, twice[0])
            raise PlanError(
                f"{e.name}: {_side_word(side)} ranks {format_ranks(twice)} appear in two layouts "
                f"({format_layout(first.layout)} and {format_layout(ld.layout)}){where}"
            )
        seen.update((r, i) for r in ld.layout.mesh.ranks)


def _overlap_text(e: TableEntry, a: LayoutDims, b: LayoutDims, rank: int) -> str:
    shape = tuple(e.meta.shape)
    ia = a.layout.dim_intervals(shape, rank)
    ib = b.layout.dim_intervals(shape, rank)
    offsets, sizes = [], []
    for da, db in zip(ia, ib, strict=True):
        both = [(max(x, u), min(y, v)) for x, y in da for u, v in db if max(x, u) < min(y, v)]
        if not both:
            return ""
        offsets.append(both[0][0])
        sizes.append(both[0][1] - both[0][0])
    return f"; rank {rank} would hold region {format_region(tuple(offsets), tuple(sizes))} twice"


def _check_tiling(e: TableEntry, side: str, ld: LayoutDims) -> None:
    if ld.overlap is not None:
        d, lo, hi = ld.overlap
        raise PlanError(
            f"{e.name}: {_side_word(side)} {dim_word(d)} [{lo}, {hi}) are held twice within "
            f"layout {format_layout(ld.layout)} (ranks {format_ranks(_ranks_holding(ld, d, lo, hi))})"
        )


def _raise_hole(e: TableEntry, src: list[LayoutDims], dst: list[LayoutDims]) -> None:
    """Every source layout must hold the whole tensor (replicas are interchangeable)."""
    ld = next(ld for ld in src if ld.gaps)
    d, lo, hi = ld.gaps[0]
    ranks = format_ranks(r for dd in dst for r in _ranks_holding(dd, d, lo, hi))
    if any(o is not ld and not any(g[0] == d and g[1] < hi and g[2] > lo for g in o.gaps) for o in src):
        raise PlanError(
            f"{e.name}: source layout {format_layout(ld.layout)} does not hold {dim_word(d)} "
            f"[{lo}, {hi}) (needed on destination ranks {ranks}); "
            "every source layout must hold the whole tensor"
        )
    raise PlanError(
        f"{e.name}: destination {dim_word(d)} [{lo}, {hi}) on ranks {ranks} are not held by any source rank"
    )


def _ranks_holding(ld: LayoutDims, d: int, lo: int, hi: int) -> list[int]:
    """Ranks of ``ld`` whose holding along dim ``d`` overlaps ``[lo, hi)`` (error path only)."""
    segs = ld.segments[d]
    subs = {segs.subs[k] for k in range(len(segs.starts)) if segs.starts[k] < hi and segs.stops[k] > lo}
    mesh = ld.layout.mesh
    return [mesh.rank_at(c) for c in mesh.coords() if ld.split_coord(c)[0][d] in subs]
