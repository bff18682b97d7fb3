"""The compact, pickle-free encoding of one rank's contribution to the layout table.

A payload is ``MAGIC``, a 4-byte little-endian length of the varint section, a 4-byte CRC-32 of
everything after the header, the varint section, then the UTF-8 string blob. Everything structural
is a varint; strings are interned per payload.

Names are interned as **templates**: the digit runs of a name become holes, so
``decoder.layers.7.mlp.experts.local_experts.113.linear_fc1.weight`` is the template
``decoder.layers.#.mlp.experts.local_experts.#.linear_fc#.weight`` plus ``(7, 113, 1)``; a model
has a few dozen templates however many layers and experts it has. Meshes are interned and their
rank lists stored as arithmetic runs ``(start, step, count)``; layouts and (shape, dtype) types are
interned too, so one record is ``template·2+side``, its numbers, a type id and a layout id.

``decode`` is total: any byte string either decodes to what ``encode`` could have produced or raises
``LayoutPayloadError``. Every count is bounded by what is left of the payload before anything is
allocated for it, mesh sizes by the world size, dtypes come from an allow-list of torch's dtypes.

Varint section: ``rank, digest_lo, digest_hi, |strings|, |string|…, |templates|, (string id)…,
|dtypes|, (string id)…, |meshes|, mesh…, |layouts|, layout…, |types|, type…, |records|, record…``.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from dataclasses import dataclass

import torch

from ..errors import LayoutPayloadError
from ..layout import Layout, Mesh, Replicate, Shard
from ..specs import TensorMeta
from . import varint

MAGIC = b"RSL2"
_HEADER = struct.Struct("<4sII")  # magic, varint section length, CRC-32 of the rest
MAX_WORLD = 1 << 20
"""The mesh-size bound ``decode`` uses when it is not given the world size."""
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
    rest = bytes(head) + bytes(body) + b"".join(blobs)
    return _HEADER.pack(MAGIC, len(head) + len(body), zlib.crc32(rest)) + rest


def _write_all(out: bytearray, *values: int) -> None:
    for v in values:
        varint.write(out, v)


def _dtype_names() -> dict[str, torch.dtype]:
    """Every dtype torch defines, by its canonical name (``str(dtype)`` without ``torch.``)."""
    found = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            found[str(value).removeprefix("torch.")] = value
    return found


DTYPES = _dtype_names()
"""The allow-list a payload's dtype names are looked up in (never ``getattr(torch, name)``)."""


class _Reader:
    """A cursor over the varint section; every count is checked against what is left."""

    def __init__(self, ints: list[int]) -> None:
        self.ints, self.pos = ints, 0

    def left(self) -> int:
        return len(self.ints) - self.pos

    def take(self, n: int) -> list[int]:
        if n > self.left():
            raise LayoutPayloadError(f"layout payload: truncated ({n} values wanted, {self.left()} left)")
        self.pos += n
        return self.ints[self.pos - n : self.pos]

    def one(self) -> int:
        return self.take(1)[0]

    def count(self, what: str, each: int = 1) -> int:
        """A count of items that take at least ``each`` values apiece."""
        n = self.one()
        if n * each > self.left():
            raise LayoutPayloadError(f"layout payload: {n} {what} cannot fit in {self.left()} values left")
        return n

    def index(self, table: list, what: str):
        i = self.one()
        if i >= len(table):
            raise LayoutPayloadError(f"layout payload: {what} id {i} out of range ({len(table)} known)")
        return table[i]


def decode(payload: bytes, world: int | None = None) -> tuple[int, int, list[Record]]:
    """``(rank, digest, records)`` of a payload made by ``encode``.

    ``world``: the number of global ranks; every rank the payload names must be below it (default
    ``MAX_WORLD``). Raises ``LayoutPayloadError`` (and nothing else) on any malformed payload.
    """
    world = MAX_WORLD if world is None else world
    payload = bytes(payload)
    if len(payload) < _HEADER.size:
        raise LayoutPayloadError(f"layout payload: {len(payload)} bytes is shorter than its header")
    magic, size, crc = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise LayoutPayloadError(f"layout payload: bad magic {magic!r} (expected {MAGIC!r})")
    rest = payload[_HEADER.size :]
    if zlib.crc32(rest) != crc:
        raise LayoutPayloadError("layout payload: checksum mismatch (corrupted or truncated)")
    if size > len(rest):
        raise LayoutPayloadError(f"layout payload: section of {size} bytes in {len(rest)} bytes")
    try:
        ints = varint.decode_all(rest[:size])
    except ValueError as exc:
        raise LayoutPayloadError(f"layout payload: {exc}") from None
    try:
        return _decode(_Reader(ints), rest[size:], world)
    except (ValueError, UnicodeDecodeError) as exc:  # from Mesh/Shard/Layout or the string blob
        raise LayoutPayloadError(f"layout payload: {exc}") from None


def _decode(r: _Reader, blob: bytes, world: int) -> tuple[int, int, list[Record]]:
    rank, lo, hi = r.take(3)
    if rank >= world:
        raise LayoutPayloadError(f"layout payload: sender rank {rank} outside a world of {world}")
    if lo >> 32 or hi >> 32:
        raise LayoutPayloadError("layout payload: digest words wider than 32 bits")
    strings, at = [], 0
    for length in r.take(r.count("strings")):
        if length > len(blob) - at:
            raise LayoutPayloadError(f"layout payload: a string of {length} bytes overruns the blob")
        strings.append(blob[at : at + length].decode())
        at += length
    if at != len(blob):
        raise LayoutPayloadError(f"layout payload: {len(blob) - at} trailing bytes after the strings")
    templates = [r.index(strings, "string").split(_HOLE) for _ in range(r.count("templates"))]
    dtypes = []
    for _ in range(r.count("dtypes")):
        name = r.index(strings, "string")
        if name not in DTYPES:
            raise LayoutPayloadError(f"layout payload: unknown dtype {name!r}")
        dtypes.append(DTYPES[name])
    meshes = [_mesh(r, world) for _ in range(r.count("meshes", 2))]
    layouts = []
    for _ in range(r.count("layouts", 2)):
        mesh = r.index(meshes, "mesh")
        placements = tuple(_placement(r) for _ in range(r.count("placements")))
        layouts.append(Layout(mesh, placements))
    types = []
    for _ in range(r.count("types", 2)):
        shape = tuple(r.take(r.count("dims")))
        types.append((shape, r.index(dtypes, "dtype")))
    records = []
    for _ in range(r.count("records", 3)):
        head = r.one()
        if head >> 1 >= len(templates):
            raise LayoutPayloadError(f"layout payload: template id {head >> 1} out of range")
        parts = templates[head >> 1]
        numbers = r.take(len(parts) - 1)
        name = parts[0] + "".join(f"{n}{p}" for n, p in zip(numbers, parts[1:], strict=True))
        shape, dtype = r.index(types, "type")
        records.append(Record(SIDES[head & 1], TensorMeta(name, shape, dtype), r.index(layouts, "layout")))
    if r.left():
        raise LayoutPayloadError(f"layout payload: {r.left()} values after the last record")
    return rank, lo | (hi << 32), records


def _mesh(r: _Reader, world: int) -> Mesh:
    shape = tuple(r.take(r.count("mesh dims")))
    size = math.prod(shape)
    if size > world:
        raise LayoutPayloadError(f"layout payload: a mesh of shape {shape} in a world of {world}")
    ranks: list[int] = []
    for _ in range(r.count("rank runs", 3)):
        start, step, count = r.take(3)
        step = varint.unzigzag(step)
        last = start + step * max(count - 1, 0)
        if count > size - len(ranks) or not (0 <= start < world and 0 <= last < world):
            raise LayoutPayloadError(
                f"layout payload: a rank run ({start}, {step}, {count}) outside the mesh"
            )
        ranks.extend(start + step * k for k in range(count))
    return Mesh(tuple(ranks), shape)


def _placement(r: _Reader) -> Replicate | Shard:
    code = r.one()
    if code == 0:
        return Replicate()
    stride = r.one()
    components = tuple(r.take(r.count("components")))
    return Shard(code - 1, stride, components, tuple(r.take(r.count("sizes"))))
