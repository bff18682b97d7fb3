"""The compact, pickle-free encoding of one rank's contribution to the layout table.

A payload is ``MAGIC``, a 4-byte little-endian length of the varint section, the varint section,
then the UTF-8 string blob. Everything structural is a varint; strings are interned per payload.

Names are interned as **templates**: the digit runs of a name become holes, so
``decoder.layers.7.mlp.experts.local_experts.113.linear_fc1.weight`` is the template
``decoder.layers.#.mlp.experts.local_experts.#.linear_fc#.weight`` plus ``(7, 113, 1)``; a model
has a few dozen templates however many layers and experts it has. Meshes are interned and their
rank lists stored as arithmetic runs ``(start, step, count)``; layouts and (shape, dtype) types are
interned too, so one record is ``template·2+side``, its numbers, a type id and a layout id.

Varint section: ``rank, digest_lo, digest_hi, |strings|, |string|…, |templates|, (string id)…,
|dtypes|, (string id)…, |meshes|, mesh…, |layouts|, layout…, |types|, type…, |records|, record…``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import torch

from ..layout import Layout, Mesh, Replicate, Shard
from ..specs import TensorMeta
from . import varint

MAGIC = b"RSL1"
_DIGITS = re.compile(r"(\d+)")
_HOLE = "\x00"
SIDES = ("src", "dst")


@dataclass(frozen=True)
class Record:
    """One (side, tensor, layout) fact a rank contributes."""

    side: str
    meta: TensorMeta
    layout: Layout


def split_name(name: str) -> tuple[str, tuple[int, ...]]:
    """``"a.12.b3"`` -> ``("a.\\0.b\\0", (12, 3))``; digit runs with a leading zero stay literal."""
    parts = _DIGITS.split(name)
    template, numbers = [], []
    for i, part in enumerate(parts):
        if i % 2 and str(int(part)) == part:
            template.append(_HOLE)
            numbers.append(int(part))
        else:
            template.append(part)
    return "".join(template), tuple(numbers)


def _runs(ranks: tuple[int, ...]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][2] == 1:
            runs[-1][1] = r - runs[-1][0]
            runs[-1][2] = 2
        elif runs and r == runs[-1][0] + runs[-1][1] * runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([r, 1, 1])
    return [tuple(run) for run in runs]


class _Interner(dict):
    def id(self, key) -> int:
        found = self.get(key)
        if found is None:
            found = self[key] = len(self)
        return found


def encode(rank: int, digest: int, records: list[Record]) -> bytes:
    """The payload of ``rank``: its records and its holding digest (see ``digest``)."""
    strings, templates, dtypes = _Interner(), _Interner(), _Interner()
    meshes, layouts, types = _Interner(), _Interner(), _Interner()
    body = bytearray()
    for rec in records:
        template, numbers = split_name(rec.meta.name)
        t = templates.id(strings.id(template))
        dtype = dtypes.id(strings.id(str(rec.meta.dtype).removeprefix("torch.")))
        ty = types.id((tuple(rec.meta.shape), dtype))
        lay = layouts.id((meshes.id(rec.layout.mesh), rec.layout.placements))
        varint.write(body, t * 2 + SIDES.index(rec.side))
        for n in numbers:
            varint.write(body, n)
        varint.write(body, ty)
        varint.write(body, lay)
    head = bytearray()
    for v in (rank, digest & 0xFFFFFFFF, digest >> 32, len(strings)):
        varint.write(head, v)
    blobs = [s.encode() for s in strings]
    for blob in blobs:
        varint.write(head, len(blob))
    for table in (templates, dtypes):
        varint.write(head, len(table))
        for string_id in table:
            varint.write(head, string_id)
    varint.write(head, len(meshes))
    for mesh in meshes:
        _write_all(head, len(mesh.shape), *mesh.shape)
        runs = _runs(mesh.ranks)
        varint.write(head, len(runs))
        for start, step, count in runs:
            _write_all(head, start, varint.zigzag(step), count)
    varint.write(head, len(layouts))
    for mesh_id, placements in layouts:
        _write_all(head, mesh_id, len(placements))
        for p in placements:
            if isinstance(p, Shard):
                _write_all(head, 1 + p.dim, p.stride, len(p.components), *p.components)
                _write_all(head, len(p.sizes), *p.sizes)
            else:
                varint.write(head, 0)
    varint.write(head, len(types))
    for shape, dtype in types:
        _write_all(head, len(shape), *shape, dtype)
    varint.write(head, len(records))
    section = bytes(head) + bytes(body)
    return MAGIC + struct.pack("<I", len(section)) + section + b"".join(blobs)


def _write_all(out: bytearray, *values: int) -> None:
    for v in values:
        varint.write(out, v)


def decode(payload: bytes) -> tuple[int, int, list[Record]]:
    """``(rank, digest, records)`` of a payload made by ``encode``."""
    if payload[:4] != MAGIC:
        raise ValueError("not a reshard layout payload (bad magic)")
    (size,) = struct.unpack_from("<I", payload, 4)
    ints = varint.decode_all(payload[8 : 8 + size])
    blob = payload[8 + size :]
    pos = 0

    def take(n: int = 1) -> list[int]:
        nonlocal pos
        pos += n
        return ints[pos - n : pos]

    rank, lo, hi, n_strings = take(4)
    strings, at = [], 0
    for length in take(n_strings):
        strings.append(blob[at : at + length].decode())
        at += length
    templates = [strings[i].split(_HOLE) for i in take(take()[0])]
    dtypes = [getattr(torch, strings[i]) for i in take(take()[0])]
    meshes = []
    for _ in range(take()[0]):
        shape = tuple(take(take()[0]))
        ranks: list[int] = []
        for _ in range(take()[0]):
            start, step, count = take(3)
            step = varint.unzigzag(step)
            ranks.extend(start + step * k for k in range(count))
        meshes.append(Mesh(tuple(ranks), shape))
    layouts = []
    for _ in range(take()[0]):
        mesh_id, n = take(2)
        placements = []
        for _ in range(n):
            code = take()[0]
            if code == 0:
                placements.append(Replicate())
            else:
                stride, n_comp = take(2)
                components = tuple(take(n_comp))
                placements.append(Shard(code - 1, stride, components, tuple(take(take()[0]))))
        layouts.append(Layout(meshes[mesh_id], tuple(placements)))
    types = []
    for _ in range(take()[0]):
        shape = tuple(take(take()[0]))
        types.append((shape, dtypes[take()[0]]))
    records = []
    for _ in range(take()[0]):
        head = take()[0]
        parts = templates[head >> 1]
        numbers = take(len(parts) - 1)
        name = parts[0] + "".join(f"{n}{p}" for n, p in zip(numbers, parts[1:], strict=True))
        ty, lay = take(2)
        shape, dtype = types[ty]
        records.append(Record(SIDES[head & 1], TensorMeta(name, shape, dtype), layouts[lay]))
    return rank, lo | (hi << 32), records
