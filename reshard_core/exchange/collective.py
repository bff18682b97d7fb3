"""``exchange_layouts``: one all-gather turns every rank's specs into the same layout table.

Each rank encodes only the (tensor, layout) facts it contributes (see ``contribute``) plus a
holding digest of all its own facts (see ``digest``); one all-gather of sizes and one of payloads
give every rank every payload; decoding them builds the table. The bytes grow with the model (one
record per tensor per layout), not with ranks × parameters. Uneven payloads travel unpadded on
NCCL (uneven all-gather); on other backends they are padded to the largest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

from ..coordination.gather import all_gather_bytes
from ..coordination.refit_group import view_of
from ..errors import PlanError
from ..plan.describe import format_layout, format_meta
from ..plan.table import LayoutTable, TableBuilder
from ..specs import TensorSpec
from .codec import decode, encode
from .contribute import contributor, own_facts, records_of
from .digest import MOD, expected_total, holding_digest


@dataclass(frozen=True)
class ExchangeStats:
    """What one exchange cost this rank.

    ``bytes``: bytes this rank received (size words and payloads, padding included);
    ``bytes_sent``: its own payload plus its size word; ``table_bytes``: all payloads together,
    the compact table every rank receives; ``records``: facts this rank contributed.
    """

    bytes: int
    bytes_sent: int
    table_bytes: int
    records: int
    world: int
    padded: bool


def exchange_layouts(
    src_specs: Iterable[TensorSpec] | None,
    dst_specs: Iterable[TensorSpec] | None,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> tuple[LayoutTable, ExchangeStats]:
    """Collective over ``group``: every rank gets the same ``LayoutTable`` of both sides.

    Meshes name refit ranks (``coordination.refit_group``). Raises ``PlanError`` on every rank when
    ranks disagree about a tensor's shape, dtype or layout, naming the tensor and the ranks;
    ``TransportError`` when a
    rank does not join within ``timeout`` seconds (None: the process group's own timeout).
    """
    view = view_of(group)
    rank = view.rank
    facts = own_facts(src_specs, dst_specs)
    records = records_of(rank, facts)
    payload = encode(rank, holding_digest(facts), records)
    payloads, received, padded = all_gather_bytes(payload, group, timeout)
    builder = TableBuilder()
    total = 0
    world = view.world
    for blob in payloads:
        sender, digest, recs = decode(blob, world)
        total += digest
        for rec in recs:
            builder.add(rec.side, sender, rec.meta, rec.layout)
    table = builder.build()
    if total % MOD != expected_total(table):
        _raise_disagreement(table, rank, facts, group, timeout)
    stats = ExchangeStats(
        bytes=received,
        bytes_sent=len(payload) + 8,
        table_bytes=sum(len(p) for p in payloads),
        records=len(records),
        world=len(payloads),
        padded=padded,
    )
    return table, stats


def _raise_disagreement(table: LayoutTable, rank: int, facts, group, timeout: float | None) -> None:
    """Error path: every rank names its own disagreement; all ranks raise the same message."""
    mine = _local_disagreement(table, rank, facts)
    texts, _, _ = all_gather_bytes((mine or "").encode(), group, timeout)
    found = [t.decode() for t in texts if t]
    if not found:
        raise PlanError("layout exchange: rank holding digests do not add up, yet no rank finds a difference")
    more = f" (and {len(found) - 3} more ranks disagree)" if len(found) > 3 else ""
    raise PlanError("layout exchange: ranks disagree about their holdings: " + "; ".join(found[:3]) + more)


def _local_disagreement(table: LayoutTable, rank: int, facts) -> str | None:
    """This rank's first difference from ``table``, named, or None when it agrees with it."""
    held = {}  # (side, name) -> the layout this rank holds it in
    for side, meta, layout in facts:
        word = "source" if side == "src" else "destination"
        entry = table.get(meta.name)
        layouts = entry.layouts(side) if entry is not None else ()
        if layout not in layouts:
            return (
                f"{meta.name}: rank {rank} holds its {word} in layout {format_layout(layout)}, which rank "
                f"{contributor(side, meta.name, layout)} did not report"
            )
        seen = entry.source_meta if side == "src" else entry.meta
        if (tuple(seen.shape), seen.dtype) != (tuple(meta.shape), meta.dtype):
            return (
                f"{meta.name}: rank {rank} holds its {word} as {format_meta(meta)}, rank "
                f"{contributor(side, meta.name, layout)} reported {format_meta(seen)}"
            )
        held[(side, meta.name)] = layout
    for e in table.entries:
        for side in ("src", "dst"):
            own = held.get((side, e.name))
            for layout in e.layouts(side):
                if rank not in layout.mesh.ranks or layout == own:
                    continue
                word = "source" if side == "src" else "destination"
                # another layout covering this rank claims its piece twice (and leaves another unheld)
                why = "which holds no such tensor"
                if own is not None:
                    why = f"which holds it in layout {format_layout(own)}"
                return (
                    f"{e.name}: rank {contributor(side, e.name, layout)} reports a {word} layout "
                    f"{format_layout(layout)} that includes rank {rank}, {why}"
                )
    return None
