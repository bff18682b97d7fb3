"""Exact plans for known cases: Megatron's own examples, local preference, replica balance, merging, ties,
batches, the planner seam and the plan cache."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from reshard_core.hookspecs import hookimpl
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan import cache
from reshard_core.plan.ops import OpKind, TransferOp
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import LayoutTable, TableBuilder
from reshard_core.plugins import register_plugin, unregister_plugin
from reshard_core.specs import TensorMeta, TensorSpec

F32 = torch.float32


def lay(ranks, *placements, shape=None) -> Layout:
    return Layout(Mesh.of(ranks, shape), tuple(placements))


def table(*tensors) -> LayoutTable:
    """``tensors``: (name, shape, src layouts, dst layouts)."""
    b = TableBuilder()
    for name, shape, src, dst in tensors:
        m = TensorMeta(name, shape, F32)
        for side, layouts in (("src", src), ("dst", dst)):
            for layout in layouts:
                b.add(side, layout.mesh.ranks[0], m, layout)
    return b.build()


def ops(plan) -> list[tuple]:
    return [(op.kind.value, op.peer, op.offsets, op.sizes, op.src_local, op.dst_local) for op in plan.ops]


def test_tp2_to_tp3_cuts_at_both_sides_boundaries_only():
    # Megatron's LCM example: dst1 <- src0[4:6], src1[0:2]; here as two ops, not micro-tiles
    t = table(("w", (12,), [lay([0, 1], Shard(0))], [lay([2, 3, 4], Shard(0))]))
    assert ops(plan_rank(t, 3)) == [
        ("recv", 0, (4,), (2,), (4,), (0,)),
        ("recv", 1, (6,), (2,), (0,), (2,)),
    ]
    assert ops(plan_rank(t, 0)) == [
        ("send", 2, (0,), (4,), (0,), (0,)),
        ("send", 3, (4,), (2,), (4,), (0,)),
    ]


def test_gated_fc1_stride_2_tp2_to_tp4():
    # Megatron's example: dst0 <- src0[0:2] -> [0:2] and src0[4:6] -> [2:4]
    t = table(("fc1", (16, 3), [lay([0, 1], Shard(0, stride=2))], [lay([2, 3, 4, 5], Shard(0, stride=2))]))
    assert ops(plan_rank(t, 2)) == [
        ("recv", 0, (0, 0), (2, 3), (0, 0), (0, 0)),
        ("recv", 0, (8, 0), (2, 3), (4, 0), (2, 0)),
    ]


def test_tiles_adjacent_in_both_local_tensors_merge_into_one_op():
    t = table(("fc1", (16, 3), [lay([0, 1], Shard(0, stride=2))], [lay([2, 3], Shard(0, stride=2))]))
    # rank 2 holds global rows [0, 4) and [8, 12): one op, local rows [0, 8) on both ends
    assert ops(plan_rank(t, 2)) == [("recv", 0, (0, 0), (8, 3), (0, 0), (0, 0))]
    assert ops(plan_rank(t, 0)) == [("send", 2, (0, 0), (8, 3), (0, 0), (0, 0))]


def test_colocated_ranks_copy_what_they_hold_locally():
    t = table(("w", (8, 4), [lay([0, 1], Shard(0))], [lay([0, 1], Shard(1))]))
    assert ops(plan_rank(t, 0)) == [
        ("local", 0, (0, 0), (4, 2), (0, 0), (0, 0)),
        ("recv", 1, (4, 0), (4, 2), (0, 0), (4, 0)),
        ("send", 1, (0, 2), (4, 2), (0, 2), (0, 0)),
    ]
    assert ops(plan_rank(t, 1)) == [
        ("send", 0, (4, 0), (4, 2), (0, 0), (4, 0)),
        ("recv", 0, (0, 2), (4, 2), (0, 2), (0, 0)),
        ("local", 1, (4, 2), (4, 2), (0, 2), (4, 0)),
    ]


def test_replicas_are_balanced_over_source_copies():
    # 4 source replicas (two layouts of a 2-wide Replicate mesh), 16 destination copies
    src = [lay([0, 1], Replicate()), lay([2, 3], Replicate())]
    dst = [lay(range(10, 26), Replicate())]
    t = table(("w", (6,), src, dst))
    senders = Counter(op.peer for r in range(10, 26) for op in plan_rank(t, r).ops)
    assert senders == {0: 4, 1: 4, 2: 4, 3: 4}


def test_balance_does_not_depend_on_rank_numbering():
    # destination copies on ranks 0, 8, 16, ... (a TP8 stride) still spread over all source copies
    src = [lay([100, 101, 102, 103], Replicate())]
    dst = [lay(range(0, 64, 8), Replicate())]
    t = table(("w", (6,), src, dst))
    senders = Counter(op.peer for r in range(0, 64, 8) for op in plan_rank(t, r).ops)
    assert senders == {100: 2, 101: 2, 102: 2, 103: 2}


def test_tied_fallback_feeds_the_destination_from_the_named_source():
    emb = "embedding.word_embeddings.weight"
    t = table(
        (emb, (8, 4), [lay([0, 1], Shard(0))], [lay([2, 3], Shard(0))]),
        ("output_layer.weight", (8, 4), [], [lay([2, 3], Shard(0))]),
    )
    plan = plan_rank(t, 0, tied=True)
    assert [(op.name, op.peer) for op in plan.ops] == [(emb, 2), ("output_layer.weight", 2)]
    assert plan.source_names == {"output_layer.weight": emb}
    assert plan_rank(t, 2, tied=True).source_names == {"output_layer.weight": emb}


def test_scalars_and_empty_tensors():
    t = table(
        ("scale", (), [lay([0, 1], Replicate())], [lay([2], Replicate())]),
        ("empty", (0, 4), [lay([0, 1], Shard(0))], [lay([2], Replicate())]),
    )
    plan = plan_rank(t, 2)
    assert [(op.name, op.kind, op.sizes) for op in plan.ops] == [("scale", OpKind.RECV, ())]


def test_batches_are_greedy_by_weight_in_name_order_and_never_split_a_tensor():
    src, dst = [lay([0, 1], Shard(0))], [lay([2, 3], Shard(0))]
    t = table(("a", (16,), src, dst), ("b", (16,), src, dst), ("c", (64,), src, dst), ("d", (8,), src, dst))
    plan = plan_rank(t, 2, max_batch_bytes=128)  # a, b = 64 B each; c = 256 B alone; d = 32 B
    assert plan.num_batches == 3
    assert [(op.name, op.batch) for op in plan.ops] == [("a", 0), ("b", 0), ("c", 1), ("d", 2)]
    assert plan_rank(t, 2).num_batches == 1


def test_weight_counts_destination_fan_out():
    # 1 source copy, 4 destination copies: one sender may pack the tensor 4 times
    t = table(
        ("a", (4,), [lay([0], Replicate())], [lay([1, 2, 3, 4], Replicate())]),
        ("b", (4,), [lay([0], Replicate())], [lay([1, 2, 3, 4], Replicate())]),
    )
    assert plan_rank(t, 0, max_batch_bytes=64).num_batches == 2
    assert plan_rank(t, 0, max_batch_bytes=128).num_batches == 1


def test_from_specs_keeps_each_layout_once():
    layout = lay([0, 1], Shard(0))
    spec = TensorSpec(TensorMeta("w", (4,), F32), layout, None)
    t = LayoutTable.from_specs({0: [spec], 1: [spec]}, {0: [spec], 1: [spec]})
    assert t["w"].src == (layout,) and t["w"].dst == (layout,)
    assert list(t) == ["w"]


class _OnlySpecial:
    """A plugin planner that claims one tensor and lets the built-in box planner do the rest."""

    @hookimpl
    def reshard_plan_tensor(self, entry, rank):
        if entry.name != "special":
            return None
        return [TransferOp(OpKind.LOCAL, "special", rank, (0,), (4,), (0,), (0,))]


def test_plugin_planners_come_first_and_the_box_planner_is_the_fallback():
    layouts = ([lay([0], Replicate())], [lay([1], Replicate())])
    t = table(("special", (4,), *layouts), ("w", (4,), *layouts))
    name = register_plugin(_OnlySpecial(), name="test-only-special")
    try:
        plan = plan_rank(t, 1)
    finally:
        unregister_plugin(name)
    assert ops(plan) == [("local", 1, (0,), (4,), (0,), (0,)), ("recv", 0, (0,), (4,), (0,), (0,))]
    assert ops(plan_rank(t, 1))[0] == ("recv", 0, (0,), (4,), (0,), (0,))


def test_an_explicit_planner_replaces_the_hook():
    t = table(("w", (4,), [lay([0], Replicate())], [lay([1], Replicate())]))
    marker = TransferOp(OpKind.LOCAL, "w", 1, (0,), (4,), (0,), (0,))
    assert plan_rank(t, 1, planner=lambda entry, rank, ctx: [marker]).ops == (marker,)


def test_plan_cache_hits_and_misses():
    cache.clear_plan_cache()
    src, dst = [lay([0, 1], Shard(0))], [lay([2, 3], Shard(0))]
    t = table(("w", (8,), src, dst))
    first, hit = cache.cached_plan_rank(t, 2)
    assert not hit
    again, hit = cache.cached_plan_rank(table(("w", (8,), src, dst)), 2)
    assert hit and again is first
    changes = [
        table(("w", (10,), src, dst)),  # shape
        table(("w", (8,), src, [lay([2, 3], Shard(0, stride=2))])),  # layout
        table(("w", (8,), src, [lay([3, 2], Shard(0))])),  # rank order
    ]
    for changed in changes:
        assert not cache.cached_plan_rank(changed, 2)[1]
    assert not cache.cached_plan_rank(t, 2, group=("gloo", (0, 1, 2, 3)))[1]
    assert not cache.cached_plan_rank(t, 2, max_batch_bytes=4)[1]
    assert not cache.cached_plan_rank(t, 2, ignore=["x"])[1]
    cache.clear_plan_cache()
    assert not cache.cached_plan_rank(t, 2)[1]


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_pure_function_of_table_and_rank(rank):
    def build():
        return table(
            (
                "w",
                (7, 5),
                [lay([0, 1, 2, 3], Shard(0), Shard(1), shape=(2, 2))],
                [lay([3, 2, 1, 0], Shard(1))],
            )
        )

    assert plan_rank(build(), rank) == plan_rank(build(), rank)
