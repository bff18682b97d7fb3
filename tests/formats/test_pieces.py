"""The mapping moves of ``reshard_core.formats.pieces``, single process, on hand-made specs.

Every local view is compared with the slice an independent formula gives, and every logical
layout with the intervals each rank must hold.
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.errors import FormatError
from reshard_core.formats.pieces import permute, regroup, rename, select, split, unpad
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.views import SplitView, materialize


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


def test_regroup_refuses_a_rank_holding_part_of_a_group():
    qkv = torch.zeros(2 * 8, 2)
    spec = _spec("qkv", qkv, _tp(4, Shard(0)), 0)
    with pytest.raises(
        FormatError, match=r"qkv: rank 0 holds \[\(0, 4\)\] along dim 0, not whole blocks of 8"
    ):
        regroup(spec, 0, 8, 0, 4, "q", 0)


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
