"""Who describes which (tensor, layout), and what each rank's payload holds.

One layout describes every rank of its mesh, so each (side, tensor, layout) is contributed once, by
one rank of the mesh chosen as ``mesh.ranks[crc32(side:name) % len(mesh)]``. Every rank of the mesh
computes the same choice. It is spread over the mesh rather than always its lowest rank because
backends without an uneven all-gather (Gloo) pad every payload to the largest one: spreading keeps
the largest payload near the mean, so padding stays small.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from ..layout import Layout
from ..plan.table import LayoutTable
from ..specs import TensorSpec
from .codec import Record, encode


def contributor(side: str, name: str, layout: Layout) -> int:
    """The rank that describes ``(side, name, layout)`` in the exchange."""
    ranks = layout.mesh.ranks
    return ranks[zlib.crc32(f"{side}:{name}".encode()) % len(ranks)]


def own_facts(src_specs: Iterable[TensorSpec] | None, dst_specs: Iterable[TensorSpec] | None):
    """This rank's (side, meta, layout) facts."""
    return [
        (side, spec.meta, spec.layout)
        for side, specs in (("src", src_specs), ("dst", dst_specs))
        for spec in (specs or ())
    ]


def records_of(rank: int, facts) -> list[Record]:
    """The facts ``rank`` contributes (those it is the contributor of)."""
    return [
        Record(side, meta, layout)
        for side, meta, layout in facts
        if contributor(side, meta.name, layout) == rank
    ]


def payloads_from_table(table: LayoutTable, ranks: Iterable[int] = ()) -> dict[int, bytes]:
    """Every rank's payload as the exchange would build it (offline; digests set to full width).

    ``ranks`` adds ranks that contribute nothing (they still send a header).
    """
    per_rank: dict[int, list[Record]] = {r: [] for r in ranks}
    for e in table.entries:
        for side, layouts in (("src", e.src), ("dst", e.dst)):
            meta = e.source_meta if side == "src" else e.meta
            for layout in layouts:
                per_rank.setdefault(contributor(side, e.name, layout), []).append(Record(side, meta, layout))
    return {r: encode(r, (1 << 64) - 1, recs) for r, recs in sorted(per_rank.items())}
