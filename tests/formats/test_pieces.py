"""The mapping moves of ``reshard_core.formats.pieces``, single process, on hand-made specs.

Every local view is compared with the slice an independent formula gives, and every logical
layout with the intervals each rank must hold.
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.errors import FormatError
from reshard_core.formats.pieces import halves, permute, regroup, rename, select, split, unpad
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.views import SplitView, copy_into, materialize


def _spec(name, full, layout, rank):
    """The spec ``rank`` holds of ``full`` under ``layout`` (its local tensor cut by the layout)."""
    dims = layout.dim_intervals(tuple(full.shape), rank)
    local = full
    for d, ivs in enumerate(dims):
        local = (
            torch.cat([local.narrow(d, a, b - a) for a, b in ivs], dim=d) if ivs else local.narrow(d, 0, 0)
        )
    return TensorSpec(TensorMeta(name, tuple(full.shape), full.dtype), layout, local.clone())


def _tp(width, placement):
    return Layout(Mesh.of(range(width)), (placement,))


def test_rename_and_permute_keep_the_holding():
    full = torch.arange(24.0).view(4, 6)
    spec = _spec("w_t", full, _tp(2, Shard(1)), 1)
    assert rename(spec, "a").meta.name == "a"
    logical = permute(spec, (1, 0), "w")
    assert logical.meta.shape == (6, 4) and logical.layout.placements == (Shard(0),)
    assert torch.equal(logical.tensor, full.t()[3:6])
    assert logical.tensor.data_ptr() == spec.tensor.data_ptr()  # a view, written in place


@pytest.mark.parametrize("rank", [0, 1])
def test_split_a_stride_2_fused_dim_into_gate_and_up(rank):
    gate, up = torch.arange(16.0).view(8, 2), 100 + torch.arange(16.0).view(8, 2)
    spec = _spec("fc1", torch.cat([gate, up]), _tp(2, Shard(0, stride=2)), rank)
    g, u = split(spec, 0, [("gate", 8), ("up", 8)], rank)
    assert g.layout.placements == (Shard(0),) and g.meta.shape == (8, 2)
    assert torch.equal(g.tensor, gate[4 * rank : 4 * rank + 4])
    assert torch.equal(u.tensor, up[4 * rank : 4 * rank + 4])


def test_split_components_and_unsharded_and_refusals():
    full = torch.arange(14.0)
    comp = _spec("qkv", full, _tp(2, Shard(0, components=(6, 8))), 1)
    a, b = split(comp, 0, [("a", 6), ("b", 8)], 1)
    assert torch.equal(a.tensor, full[3:6]) and torch.equal(b.tensor, full[10:14])
    rep = _spec("x", full, _tp(2, Replicate()), 0)
    a, b = split(rep, 0, [("a", 6), ("b", 8)], 0)
    assert torch.equal(b.tensor, full[6:]) and b.layout == rep.layout
    with pytest.raises(
        FormatError, match=r"x: parts \{'a': 6, 'b': 7\} sum to 13 along dim 0, the tensor has 14"
    ):
        split(rep, 0, [("a", 6), ("b", 7)], 0)
    plain = _spec("y", full, _tp(2, Shard(0)), 0)
    with pytest.raises(
        FormatError, match=r"y: parts of sizes \(6, 8\) cannot be cut out of a Shard\(0\) shard"
    ):
        split(plain, 0, [("a", 6), ("b", 8)], 0)


def test_select_one_expert_of_an_uneven_fsdp_stack():
    experts = torch.arange(6 * 2 * 3.0).view(6, 2, 3)
    layout = Layout(Mesh.of(range(4)), (Shard(0),))  # torch.chunk: 2, 2, 2, 0 experts
    for rank in range(4):
        spec = _spec("w", experts, layout, rank)
        for e in range(6):
            got = select(spec, 0, e, f"e{e}", rank)
            if rank != e // 2:
                assert got is None
                continue
            assert got.meta.shape == (2, 3)
            assert got.layout == Layout(Mesh((rank,), (1,)), (Replicate(),))
            assert torch.equal(got.tensor, experts[e])


def test_select_keeps_the_other_mesh_dims():
    experts = torch.arange(4 * 6 * 2.0).view(4, 6, 2)
    layout = Layout(Mesh.of(range(4), (2, 2)), (Shard(0), Shard(1)))  # EP over dim 0, TP over rows
    spec = _spec("w", experts, layout, 3)
    got = select(spec, 0, 3, "e3", 3)
    assert got.layout == Layout(Mesh((2, 3), (2,)), (Shard(0),))
    assert torch.equal(got.tensor, experts[3, 3:6])


def test_regroup_group_major_qkv_with_two_groups_per_rank():
    p, h, hidden, groups = 2, 3, 4, 4
    block = (p + 2) * h
    qkv = torch.arange(groups * block * hidden, dtype=torch.float32).view(groups * block, hidden)
    q_ref = torch.cat([qkv[g * block : g * block + p * h] for g in range(groups)])
    k_ref = torch.cat([qkv[g * block + p * h : g * block + (p + 1) * h] for g in range(groups)])
    for rank in range(2):
        spec = _spec("qkv", qkv, _tp(2, Shard(0)), rank)
        q = regroup(spec, 0, block, 0, p * h, "q", rank)
        k = regroup(spec, 0, block, p * h, h, "k", rank)
        assert q.meta.shape == (groups * p * h, hidden) and q.layout.placements == (Shard(0),)
        assert isinstance(q.tensor, SplitView)
        assert torch.equal(materialize(q.tensor.region((0, 0), tuple(q.tensor.shape))), q_ref.chunk(2)[rank])
        assert torch.equal(materialize(k.tensor.region((0, 0), tuple(k.tensor.shape))), k_ref.chunk(2)[rank])


@pytest.mark.parametrize("rank", range(4))
def test_regroup_a_rank_holding_part_of_one_group(rank):
    # TP4 over 2 groups of [q: 4 rows; k: 2; v: 2] (TP > query groups): a rank holds half a group
    q_ref, k_ref, v_ref = (
        torch.arange(16.0).view(8, 2),
        100 + torch.arange(8.0).view(4, 2),
        -torch.arange(8.0),
    )
    v_ref = v_ref.view(4, 2)
    qkv = torch.cat([q_ref[:4], k_ref[:2], v_ref[:2], q_ref[4:], k_ref[2:], v_ref[2:]])
    spec = _spec("qkv", qkv, _tp(4, Shard(0)), rank)
    q, k, v = (regroup(spec, 0, 8, a, n, x, rank) for x, a, n in (("q", 0, 4), ("k", 4, 2), ("v", 6, 2)))
    assert q.layout.placements == (Shard(0, sizes=(4, 0, 4, 0)),) and q.meta.shape == (8, 2)
    assert k.layout.placements == (Shard(0, sizes=(0, 2, 0, 2)),) and k.meta.shape == (4, 2)
    for logical, ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
        (a, b), *_ = logical.layout.dim_intervals((8 if ref is q_ref else 4, 2), rank)[0] or [(0, 0)]
        assert torch.equal(logical.tensor, ref[a:b])
        assert logical.tensor.numel() == 0 or logical.tensor.data_ptr() >= spec.tensor.data_ptr()


def test_regroup_refuses_a_rank_holding_parts_of_two_groups():
    qkv = torch.zeros(2 * 6, 2)  # TP3 over 2 groups of 6 rows: rank 1 holds rows [4, 8)
    spec = _spec("qkv", qkv, _tp(3, Shard(0)), 1)
    with pytest.raises(
        FormatError,
        match=r"^qkv: rank 1 holds \[\(4, 8\)\] along dim 0: neither whole blocks of 6 nor part of one$",
    ):
        regroup(spec, 0, 6, 0, 2, "q", 1)


def _interleaved(halves: torch.Tensor, head: int) -> torch.Tensor:
    """Rows of each head reordered from halves (HF) to adjacent pairs (Megatron rotary_interleaved)."""
    return halves.unflatten(0, (-1, 2, head // 2)).transpose(1, 2).flatten(0, 2)


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_regroup_rotary_pairs_into_halves(tp, rank):
    # 2 groups of [q: 2 heads of 4 rows; k: 4; v: 4]; q and k rows stored as adjacent rotary pairs
    q_ref, k_ref = torch.arange(32.0).view(16, 2), 100 + torch.arange(16.0).view(8, 2)
    v_ref = -1 - torch.arange(16.0).view(8, 2)
    q_mem, k_mem = _interleaved(q_ref, 4), _interleaved(k_ref, 4)
    qkv = torch.cat([q_mem[:8], k_mem[:4], v_ref[:4], q_mem[8:], k_mem[4:], v_ref[4:]])
    spec = _spec("qkv", qkv, _tp(tp, Shard(0)), rank)
    pieces = (("q", 0, 8, 4, q_ref), ("k", 8, 4, 4, k_ref), ("v", 12, 4, 0, v_ref))
    for name, start, size, pairs, ref in pieces:
        logical = regroup(spec, 0, 16, start, size, name, rank, pairs_of=pairs)
        held = logical.layout.dim_intervals(tuple(ref.shape), rank)[0]
        want = torch.cat([ref[a:b] for a, b in held]) if held else ref[:0]
        got = logical.tensor
        got = materialize(got.region((0, 0), tuple(got.shape))) if isinstance(got, SplitView) else got
        assert torch.equal(got, want), (name, tp, rank)


def test_halves_of_a_norm_weight_and_writes_land_in_the_parameter():
    weight = torch.arange(8.0)  # q_norm over a head of 8: pairs (0, 1), (2, 3), ...
    spec = _spec("q_norm", weight, _tp(2, Replicate()), 0)
    logical = halves(spec, 0, 8, "q_norm.weight")
    assert torch.equal(
        materialize(logical.tensor.region((0,), (8,))), torch.tensor([0.0, 2, 4, 6, 1, 3, 5, 7])
    )
    copy_into(logical.tensor.region((0,), (8,)), torch.arange(10.0, 18.0))
    assert torch.equal(spec.tensor, torch.tensor([10.0, 14, 11, 15, 12, 16, 13, 17]))


def test_unpad_a_tp_sharded_vocab():
    padded = torch.arange(16 * 2.0).view(16, 2)  # V = 10 real rows, padded to 16 over 4 ranks of 4
    for rank in range(4):
        spec = _spec("emb", padded, _tp(4, Shard(0)), rank)
        logical, pad = unpad(spec, 0, 10, "embed", rank)
        assert logical.layout.placements == (Shard(0, sizes=(4, 4, 2, 0)),)
        assert logical.meta.shape == (10, 2)
        real = max(0, min(4, 10 - 4 * rank))
        assert torch.equal(logical.tensor, padded[4 * rank : 4 * rank + real])
        assert (pad is None) == (real == 4)
        if pad is not None:
            assert torch.equal(pad, padded[4 * rank + real : 4 * rank + 4])
    meta_only = TensorSpec(TensorMeta("emb", (16, 2), torch.float32), _tp(4, Shard(0)), None)
    assert unpad(meta_only, 0, 10, "embed", 0) == (
        TensorSpec(TensorMeta("embed", (10, 2), torch.float32), _tp(4, Shard(0, sizes=(4, 4, 2, 0))), None),
        None,
    )
