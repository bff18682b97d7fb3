"""The built-in box planner: one logical tensor, one rank, its ordered ops.

**Tiles.** For a receiver ``q`` and each of its destination boxes (in ``Layout.boxes`` order), the
box is cut by the source side's refined per-dim segments (bisect per dim) into pieces, in
row-major order. Every piece is held whole by one rank per replica of the source side.

**Replica choice** (a pure function both ends evaluate):

- ``q`` holds the piece on the source side → a LOCAL copy;
- otherwise replica number ``t = (rho + salt) % S``, where ``S`` counts the source copies of every
  element (over all source layouts and their replicate mesh dims), ``rho`` numbers ``q``'s copy
  among the destination copies the same way, and ``salt = crc32(name)`` spreads tensors.
  Destination copies are distinct, so one source copy serves at most ``ceil(D / S)`` receivers of
  an element (``D`` destination copies): balanced over replicas, whatever the rank numbering.

**Senders** enumerate the same tiles: for each destination layout they bisect its per-dim
segments with the sender's own intervals to find the receivers whose boxes overlap, then replay
each receiver's tiles restricted to segments the sender owns. Both ends see the same subsequence
of tiles for a pair, so they merge identically: consecutive tiles of one (tensor, peer) whose
regions are adjacent along one dim in **both** local tensors become one op (strided layouts make
such tiles non-adjacent globally; ``TransferOp.offsets`` then locates the first tile).

Ops are ordered by destination rank, then tile order: the n-th send A→B pairs with the n-th
receive on B from A.
"""

from __future__ import annotations

import zlib
from itertools import product

from .index import LayoutDims, SideIndex
from .ops import OpKind, TransferOp
from .planner_context import PlanContext
from .table import TableEntry


def plan_tensor(entry: TableEntry, rank: int, context: PlanContext) -> list[TransferOp]:
    """Ops of ``rank`` for ``entry``: its receives/local copies and its sends, canonical order."""
    shape = tuple(entry.meta.shape)
    src = context.index.side(entry.name, "src", entry.src, shape)
    dst = context.index.side(entry.name, "dst", entry.dst, shape)
    if not src.dims or not dst.dims:
        return []
    salt = zlib.crc32(entry.name.encode())
    keyed: list[tuple[int, list[TransferOp]]] = []
    me_dst = dst.member(rank)
    if me_dst is not None:
        keyed.append((rank, _receiver_ops(entry.name, src, dst, rank, me_dst, salt, None)))
    me_src = src.member(rank)
    if me_src is not None:
        for q, place in _receivers_of(src, dst, shape, me_src, salt):
            if q != rank:
                keyed.append((q, _receiver_ops(entry.name, src, dst, q, place, salt, (rank, me_src))))
    keyed.sort(key=lambda kv: kv[0])
    return [op for _, ops in keyed for op in ops]


def _receivers_of(
    src: SideIndex, dst: SideIndex, shape: tuple[int, ...], me: tuple[int, tuple[int, ...]], salt: int
) -> list[tuple[int, tuple[int, tuple[int, ...]]]]:
    """Destination ranks that may take remote pieces from the sender, as (rank, (layout, coord)).

    Those overlap the sender's holding (bisect per dim) and have a replica number ``rho`` with
    ``(rho + salt) % S`` equal to the sender's, so only that progression of replicas is visited.
    """
    sd = src.dims[me[0]]
    held = sd.layout.dim_intervals_at(shape, me[1])
    mine = src.offsets[me[0]] + sd.split_coord(me[1])[1]
    found: dict[int, tuple[int, tuple[int, ...]]] = {}
    for k, dd in enumerate(dst.dims):
        first = (mine - salt - dst.offsets[k]) % src.total
        reps = range(first, dd.rep_size, src.total)
        if not reps:
            continue
        per_dim = []
        for d, segs in enumerate(dd.segments):
            subs = sorted({segs.subs[i] for a, b in held[d] if b > a for i in segs.overlapping(a, b)})
            if not subs:
                break
            per_dim.append(subs)
        else:
            for subs in product(*per_dim):
                for j in reps:
                    coord = dd.coord_of(subs, j)
                    found.setdefault(dd.layout.mesh.rank_at(coord), (k, coord))
    return sorted(found.items())


def _receiver_ops(
    name: str,
    src: SideIndex,
    dst: SideIndex,
    q: int,
    place: tuple[int, tuple[int, ...]],
    salt: int,
    sender: tuple[int, tuple[int, tuple[int, ...]]] | None,
) -> list[TransferOp]:
    """Ops for receiver ``q``: all of them, or (``sender`` given) only those that sender sends."""
    dd: LayoutDims = dst.dims[place[0]]
    _, rep = dd.split_coord(place[1])
    rho = dst.offsets[place[0]] + rep
    t_remote = (rho + salt) % src.total
    if sender is not None:
        s_rank, (i_s, coord_s) = sender
        subs_s, rep_s = src.dims[i_s].split_coord(coord_s)
        if src.offsets[i_s] + rep_s != t_remote:
            return []  # this receiver's remote pieces come from another replica
    i_remote = max(i for i, off in enumerate(src.offsets) if off <= t_remote)
    j_remote = t_remote - src.offsets[i_remote]
    mine = src.member(q)
    mine_subs = src.dims[mine[0]].split_coord(mine[1])[0] if mine is not None else None
    refined = src.refined
    merger = _Merger()
    intervals = dd.layout.dim_intervals_at(dd.shape, place[1])
    per_dim_boxes = []
    for ivs in intervals:
        pos, row = 0, []
        for a, b in ivs:
            if b > a:
                row.append((a, b, pos))
            pos += b - a
        per_dim_boxes.append(row)
    for box in product(*per_dim_boxes):
        per_dim = []
        for d, (a, b, _) in enumerate(box):
            ks = refined[d].overlapping(a, b)
            if sender is not None:
                ks = [k for k in ks if refined[d].owners[k][i_s][0] == subs_s[d]]
            per_dim.append(ks)
        for ks in product(*per_dim):
            local = mine is not None and all(
                refined[d].owners[k][mine[0]][0] == mine_subs[d] for d, k in enumerate(ks)
            )
            if local and sender is not None:
                continue
            i = mine[0] if local else i_remote
            offsets, sizes, src_local, dst_local, subs = [], [], [], [], []
            for d, k in enumerate(ks):
                a, b, box_local = box[d]
                start = refined[d].starts[k]
                lo, hi = max(a, start), min(b, refined[d].stops[k])
                sub, seg_local = refined[d].owners[k][i]
                offsets.append(lo)
                sizes.append(hi - lo)
                src_local.append(seg_local + lo - start)
                dst_local.append(box_local + lo - a)
                subs.append(sub)
            if local:
                kind, peer = OpKind.LOCAL, q
            elif sender is not None:
                kind, peer = OpKind.SEND, q
            else:
                kind, peer = OpKind.RECV, src.dims[i].rank_of(tuple(subs), j_remote)
            merger.add(
                TransferOp(kind, name, peer, tuple(offsets), tuple(sizes), tuple(src_local), tuple(dst_local))
            )
    return merger.ops


class _Merger:
    """Appends tiles, merging each into the previous tile of the same (kind, peer) when adjacent
    along one dim in both local tensors with equal extents elsewhere."""

    def __init__(self) -> None:
        self.ops: list[TransferOp] = []
        self._last: dict[tuple[OpKind, int], int] = {}

    def add(self, op: TransferOp) -> None:
        key = (op.kind, op.peer)
        at = self._last.get(key)
        if at is not None:
            merged = _merge(self.ops[at], op)
            if merged is not None:
                self.ops[at] = merged
                return
        self._last[key] = len(self.ops)
        self.ops.append(op)


def _merge(a: TransferOp, b: TransferOp) -> TransferOp | None:
    along = None
    for d in range(len(a.sizes)):
        if a.sizes[d] == b.sizes[d] and a.src_local[d] == b.src_local[d] and a.dst_local[d] == b.dst_local[d]:
            continue
        if along is not None:
            return None
        if a.src_local[d] + a.sizes[d] != b.src_local[d] or a.dst_local[d] + a.sizes[d] != b.dst_local[d]:
            return None
        along = d
    if along is None:
        return None
    sizes = list(a.sizes)
    sizes[along] += b.sizes[along]
    return TransferOp(a.kind, a.name, a.peer, a.offsets, tuple(sizes), a.src_local, a.dst_local, a.batch)
