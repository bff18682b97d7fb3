"""Compact layout exchange: codec round trips, sizes, and a real 4-rank Gloo world."""

from __future__ import annotations

import signal
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_core.errors import LayoutPayloadError, PlanError
from reshard_core.exchange import exchange_layouts
from reshard_core.exchange.codec import Record, decode, encode, split_name
from reshard_core.exchange.contribute import contributor, payloads_from_table
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.table import LayoutTable
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.testing.world import run_world

BF16 = torch.bfloat16


def test_names_become_templates_with_numeric_holes():
    assert split_name("decoder.layers.7.mlp.experts.local_experts.113.linear_fc1.weight") == (
        "decoder.layers.\0.mlp.experts.local_experts.\0.linear_fc\0.weight",
        (7, 113, 1),
    )
    assert split_name("a.007.b0") == ("a.007.b\0", (0,))
    assert split_name("plain") == ("plain", ())


names = st.text(alphabet="ab.0123456789_", min_size=1, max_size=20)
placements = st.one_of(
    st.just(Replicate()),
    st.builds(Shard, st.integers(0, 3), st.integers(1, 4)),
    st.builds(
        lambda d, c: Shard(d, components=tuple(c)), st.integers(0, 3), st.lists(st.integers(0, 9), max_size=3)
    ),
    st.builds(
        lambda d, n: Shard(d, sizes=tuple(n)), st.integers(0, 3), st.lists(st.integers(0, 300), max_size=4)
    ),
)


@st.composite
def records(draw):
    n = draw(st.integers(1, 6))
    ranks = draw(st.permutations(range(40)))[:n]
    mesh = Mesh(tuple(ranks), (n,))
    return Record(
        draw(st.sampled_from(["src", "dst"])),
        TensorMeta(
            draw(names),
            tuple(draw(st.lists(st.integers(0, 10**6), max_size=4))),
            draw(st.sampled_from([torch.float32, BF16, torch.float8_e4m3fn, torch.int64])),
        ),
        Layout(mesh, (draw(placements),)),
    )


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**5), st.integers(0, 2**64 - 1), st.lists(records(), max_size=8))
def test_codec_round_trip(rank, digest, recs):
    assert decode(encode(rank, digest, recs)) == (rank, digest, recs)


def test_mesh_runs_keep_rank_order_and_shape():
    mesh = Mesh((9, 7, 5, 3, 100, 4, 0), (7,))
    rec = Record("src", TensorMeta("x", (3,), BF16), Layout(mesh, (Replicate(),)))
    assert decode(encode(1, 0, [rec]))[2][0].layout.mesh == mesh


def test_a_record_costs_a_few_bytes_once_templates_are_known():
    mesh = Mesh.of(range(8))
    recs = [
        Record(
            "dst",
            TensorMeta(
                f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight", (4096, 7168), BF16
            ),
            Layout(mesh, (Shard(0, stride=2),)),
        )
        for layer in range(60)
        for e in range(100)
    ]
    size = len(encode(0, 0, recs))
    assert size < 7 * len(recs)  # template, 3 numbers (one of 2 bytes), type, layout


# ---- a total decoder: every malformed payload is one LayoutPayloadError -------------------------


def _varints(*values: int) -> bytes:
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _sealed(section: bytes, blob: bytes = b"") -> bytes:
    """A payload as the wire format defines it: magic, section length, CRC-32 of the rest, rest."""
    return b"RSL2" + struct.pack("<II", len(section), zlib.crc32(section + blob)) + section + blob


HUGE = 2**40


@pytest.mark.parametrize(
    "payload, message",
    [
        (
            _sealed(_varints(0, 0, 0, HUGE)),
            "layout payload: 1099511627776 strings cannot fit in 0 values left",
        ),
        (  # 45 bytes claiming a 2^40-rank mesh
            _sealed(_varints(0, 0, 0, 0, 0, 0, 1, 1, HUGE, 1, 0, 2, HUGE, 0, 0, 0)),
            "layout payload: a mesh of shape (1099511627776,) in a world of 1048576",
        ),
        (  # ranks 0, -1
            _sealed(_varints(0, 0, 0, 0, 0, 0, 1, 1, 2, 1, 0, 1, 2, 0, 0, 0)),
            "layout payload: a rank run (0, -1, 2) outside the mesh",
        ),
        (
            _sealed(_varints(0, 0, 0, 1, 100), b"ab"),
            "layout payload: a string of 100 bytes overruns the blob",
        ),
        (_sealed(_varints(0, 0, 0, 1, 4, 0, 1, 0), b"load"), "layout payload: unknown dtype 'load'"),
        (_sealed(_varints(0, 0, 0, 1, 2), b"\xff\xfe"), "layout payload: 'utf-8' codec can't decode"),
        (
            _sealed(_varints(7, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
            "layout payload: sender rank 7 outside a world of 4",
        ),
        (
            _sealed(_varints(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5)),
            "layout payload: 1 values after the last record",
        ),
        (_sealed(b"\x80"), "layout payload: truncated varint at the end of the buffer"),
        (b"RSL2\x00", "layout payload: 5 bytes is shorter than its header"),
        (b"\x80\x03" + bytes(10), "layout payload: bad magic"),
    ],
)
def test_malformed_payloads_raise_one_error_type_naming_the_fault(payload, message):
    with pytest.raises(LayoutPayloadError) as err:
        decode(payload, world=4 if "sender rank" in message else None)
    assert str(err.value).startswith(message)


def test_a_corrupted_byte_fails_the_checksum():
    good = encode(1, 5, [Record("src", TensorMeta("a.1", (4,), BF16), Layout.replicated((0, 1)))])
    bad = good[:-1] + bytes([good[-1] ^ 1])
    with pytest.raises(LayoutPayloadError, match="checksum mismatch"):
        decode(bad)


class _Hung(Exception):
    pass


def _bounded(fn, *args):
    """``fn(*args)``, interrupted after 20 s (a decoder that loops or allocates without bound)."""

    def stop(*_):
        raise _Hung("decode did not finish")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _decode_or_error(payload: bytes) -> None:
    """Either a LayoutPayloadError or a result that is itself a valid payload's content."""
    try:
        rank, digest, recs = _bounded(decode, payload, 64)
    except LayoutPayloadError:
        return
    assert decode(encode(rank, digest, recs), 64) == (rank, digest, recs)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_decode_by_accident(data):
    _decode_or_error(data)
    _decode_or_error(b"RSL2" + data)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(records(), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 10**4), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(-3, 3),
)
def test_mutated_resealed_payloads_decode_validly_or_raise(recs, edits, resize):
    """Edits behind a recomputed checksum reach every branch of the decoder."""
    good = encode(3, 9, recs)
    (size,) = struct.unpack_from("<I", good, 4)
    section, blob = bytearray(good[12 : 12 + size]), bytearray(good[12 + size :])
    for pos, value in edits:
        target = section if pos % 3 or not blob else blob
        target[pos % len(target)] = value
    if resize > 0:
        section += bytes(resize)
    elif resize < 0:
        del section[resize:]
    _decode_or_error(_sealed(bytes(section), bytes(blob)))


# ---- real Gloo world -----------------------------------------------------------------------------


def rank_specs(rank: int, bad_rank: int | None = None):
    """Hand-made specs for a 4-rank world: TP2×DP2 source (PP-like placement of two tensors),
    TP4 destination, per-replica layouts and a replicated norm."""
    tp_dp = Mesh((0, 1, 2, 3), (2, 2))  # dp outer, tp inner
    dst_mesh = Mesh.of(range(4))
    src, dst = [], []
    shape = (8, 6) if rank != bad_rank else (8, 5)
    src.append(
        TensorSpec(
            TensorMeta("decoder.layers.0.mlp.linear_fc1.weight", shape, BF16),
            Layout(tp_dp, (Replicate(), Shard(0, stride=2))),
            None,
        )
    )
    stage = (0, 1) if rank < 2 else (2, 3)
    name = "embedding.word_embeddings.weight" if rank < 2 else "output_layer.weight"
    src.append(TensorSpec(TensorMeta(name, (10, 6), BF16), Layout(Mesh.of(stage), (Shard(0),)), None))
    replica = (0, 2) if rank in (0, 2) else (1, 3)
    src.append(
        TensorSpec(
            TensorMeta("decoder.final_layernorm.weight", (6,), torch.float32),
            Layout(Mesh.of(replica), (Replicate(),)),
            None,
        )
    )
    for n, s in (
        ("decoder.layers.0.mlp.linear_fc1.weight", (8, 6)),
        ("embedding.word_embeddings.weight", (10, 6)),
        ("output_layer.weight", (10, 6)),
    ):
        dst.append(TensorSpec(TensorMeta(n, s, BF16), Layout(dst_mesh, (Shard(0),)), None))
    dst.append(
        TensorSpec(
            TensorMeta("decoder.final_layernorm.weight", (6,), torch.float32),
            Layout(dst_mesh, (Replicate(),)),
            None,
        )
    )
    return src, dst


def _exchange_entry(rank, world_size, bad_rank):
    src, dst = rank_specs(rank, bad_rank)
    try:
        table, stats = exchange_layouts(src, dst)
    except PlanError as err:
        return str(err)
    everyone = {r: rank_specs(r) for r in range(world_size)}
    direct = LayoutTable.from_specs(
        {r: s for r, (s, _) in everyone.items()}, {r: d for r, (_, d) in everyone.items()}
    )
    return table == direct, stats


@pytest.mark.slow
def test_exchange_on_a_gloo_world_builds_the_same_table_as_direct_building():
    results = run_world(_exchange_entry, 4, None, timeout=120)
    assert [ok for ok, _ in results] == [True] * 4
    stats = [s for _, s in results]
    assert len({s.table_bytes for s in stats}) == 1
    widest = max(s.bytes_sent - 8 for s in stats)
    assert all(s.bytes == 4 * 8 + 4 * widest and s.padded and s.world == 4 for s in stats)
    assert sum(s.records for s in stats) == 9  # 5 source facts (2 norm replicas) + 4 destination facts


@pytest.mark.slow
def test_a_rank_that_disagrees_with_its_mesh_fails_every_rank_naming_tensor_and_rank():
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    reporter = contributor("src", name, Layout(Mesh((0, 1, 2, 3), (2, 2)), (Replicate(), Shard(0, stride=2))))
    bad = next(r for r in range(4) if r != reporter)
    results = run_world(_exchange_entry, 4, bad, timeout=120)
    want = (
        f"layout exchange: ranks disagree about their holdings: {name}: rank {bad} holds its source as "
        f"shape (8, 5) bfloat16, rank {reporter} reported shape (8, 6) bfloat16"
    )
    assert results == [want] * 4


def test_offline_payloads_match_what_ranks_would_send():
    everyone = {r: rank_specs(r) for r in range(4)}
    table = LayoutTable.from_specs(
        {r: s for r, (s, _) in everyone.items()}, {r: d for r, (_, d) in everyone.items()}
    )
    payloads = payloads_from_table(table, range(4))
    decoded = [decode(p) for p in payloads.values()]
    assert sorted(r for r, _, _ in decoded) == [0, 1, 2, 3]
    assert sum(len(recs) for _, _, recs in decoded) == 9
