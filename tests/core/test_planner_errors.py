"""Every bad input is one PlanError, raised before data moves, naming the tensor, the ranks and the region."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from reshard_core.errors import PlanError
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import LayoutTable, TableBuilder
from reshard_core.plan.validate import validate_table
from reshard_core.specs import TensorMeta, TensorSpec

W = "decoder.layers.3.mlp.linear_fc1.weight"


def lay(ranks, *placements) -> Layout:
    return Layout(Mesh.of(ranks), tuple(placements))


def meta(name=W, shape=(8, 4), dtype=torch.float32) -> TensorMeta:
    return TensorMeta(name, shape, dtype)


def table(src, dst) -> LayoutTable:
    b = TableBuilder()
    for side, items in (("src", src), ("dst", dst)):
        for m, layout in items:
            for r in layout.mesh.ranks:
                b.add(side, r, m, layout)
    return b.build()


def raises(text: str):
    return pytest.raises(PlanError, match="^" + re.escape(text) + "$")


@dataclass(frozen=True)
class Holey(Layout):
    """A layout that leaves rows [48, 64) unheld (as a buggy extractor or a new placement could)."""

    def dim_intervals_at(self, shape, coord):
        dims = list(super().dim_intervals_at(shape, coord))
        dims[0] = tuple(iv for a, b in dims[0] for iv in ((a, min(b, 48)), (max(a, 64), b)) if iv[1] > iv[0])
        return tuple(dims)


@dataclass(frozen=True)
class Overlapping(Layout):
    """A layout whose shards overlap by two rows."""

    def dim_intervals_at(self, shape, coord):
        dims = list(super().dim_intervals_at(shape, coord))
        dims[0] = tuple((a, min(shape[0], b + 2)) for a, b in dims[0])
        return tuple(dims)


def test_name_on_the_source_only():
    t = table([(meta(), lay([0, 1], Shard(0)))], [])
    with raises(
        f"{W}: on the source only (ranks [0, 1]), no destination holds it; "
        f"pass ignore=['{W}'] to leave it out"
    ):
        plan_rank(t, 0)


def test_name_on_the_destination_only():
    t = table(
        [(meta("x"), lay([0, 1], Shard(0)))],
        [(meta("x"), lay([2, 3], Shard(0))), (meta(), lay([2, 3], Replicate()))],
    )
    with raises(
        f"{W}: on the destination only (ranks [2, 3]), no source holds it; pass ignore=['{W}'] to leave "
        "it out, or tied= to feed it from another tensor"
    ):
        plan_rank(t, 3)


def test_ignore_patterns_opt_out_explicitly():
    t = table(
        [(meta("x"), lay([0, 1], Shard(0)))],
        [(meta("x"), lay([2, 3], Shard(0))), (meta(), lay([2, 3], Replicate()))],
    )
    plan = plan_rank(t, 3, ignore=["decoder.layers.*.mlp.*"])
    assert set(plan.tensors) == {"x"}


def test_global_shape_disagreement():
    t = table([(meta(), lay([0, 1], Shard(0)))], [(meta(shape=(8, 6)), lay([2, 3], Shard(0)))])
    with raises(
        f"{W}: source shape (8, 4) float32 on ranks [0, 1] "
        "but destination shape (8, 6) float32 on ranks [2, 3]"
    ):
        plan_rank(t, 0)


def test_dtype_disagreement():
    t = table([(meta(dtype=torch.bfloat16), lay([0, 1], Shard(0)))], [(meta(), lay([2, 3], Shard(0)))])
    with raises(
        f"{W}: source is bfloat16 on ranks [0, 1], destination float32 on ranks [2, 3]; only the dtype "
        "differs (same shape (8, 4)); pass cast=True to convert on the way (the sender converts)"
    ):
        validate_table(t)


def test_ranks_of_one_side_disagree_on_shape():
    b = TableBuilder()
    b.add("src", 0, meta(), lay([0, 1], Shard(0)))
    b.add("src", 1, meta(shape=(8, 6)), lay([0, 1], Shard(0)))
    with raises(
        f"{W}: source ranks disagree on shape or dtype: shape (8, 4) float32 on ranks [0] vs "
        "shape (8, 6) float32 on ranks [1]"
    ):
        b.build()


def test_ranks_of_one_side_disagree_via_from_specs():
    spec = TensorSpec(meta(), lay([0, 1], Shard(0)), None)
    bad = TensorSpec(meta(dtype=torch.float16), lay([0, 1], Shard(0)), None)
    with raises(
        f"{W}: destination ranks disagree on shape or dtype: shape (8, 4) float32 on ranks [0] vs "
        "shape (8, 4) float16 on ranks [1]"
    ):
        LayoutTable.from_specs({0: [spec], 1: [spec]}, {0: [spec], 1: [bad]})


def test_placement_on_a_missing_dim():
    t = table([(meta(), lay([0, 1], Shard(2)))], [(meta(), lay([2, 3], Shard(0)))])
    with raises(
        f"{W}: source layout mesh (2,) on ranks [0, 1] (Shard(2)) does not fit shape (8, 4): "
        "Shard(2) on a 2-d tensor (ranks [0, 1])"
    ):
        plan_rank(t, 2)


def test_components_that_do_not_add_up():
    t = table([(meta(), lay([0, 1], Shard(0)))], [(meta(), lay([2, 3], Shard(0, components=(3, 4))))])
    with raises(
        f"{W}: destination layout mesh (2,) on ranks [2, 3] (Shard(0, components=(3, 4))) does not fit "
        "shape (8, 4): Shard(0, components=(3, 4)): components sum to 7, extent is 8 (ranks [2, 3])"
    ):
        plan_rank(t, 2)


def test_destination_rank_holding_an_element_twice():
    t = table(
        [(meta(), lay([0, 1], Shard(0)))],
        [(meta(), lay([2, 3], Shard(0))), (meta(), lay([3, 4], Replicate()))],
    )
    with raises(
        f"{W}: destination ranks [3] appear in two layouts (mesh (2,) on ranks [2, 3] (Shard(0)) and "
        "mesh (2,) on ranks [3, 4] (Replicate())); rank 3 would hold region [4:8, 0:4] twice"
    ):
        plan_rank(t, 0)


def test_source_rank_in_two_layouts():
    t = table(
        [(meta(), lay([0, 1], Shard(0))), (meta(), lay([1, 2], Shard(0)))],
        [(meta(), lay([2, 3], Shard(0)))],
    )
    with raises(
        f"{W}: source ranks [1] appear in two layouts (mesh (2,) on ranks [0, 1] (Shard(0)) and "
        "mesh (2,) on ranks [1, 2] (Shard(0)))"
    ):
        plan_rank(t, 0)


def test_hole_names_the_destination_rows_and_ranks():
    m = meta(shape=(64, 8))
    t = table([(m, Holey(Mesh.of([0, 1]), (Shard(0),)))], [(m, lay([0, 1, 2, 3], Shard(0)))])
    with raises(f"{W}: destination rows [48, 64) on ranks [3] are not held by any source rank"):
        plan_rank(t, 0)


def test_replica_layout_with_a_hole():
    m = meta(shape=(64, 8))
    t = table(
        [(m, Holey(Mesh.of([0, 1]), (Shard(0),))), (m, lay([4, 5], Shard(0)))],
        [(m, lay([0, 1, 2, 3], Shard(0)))],
    )
    with raises(
        f"{W}: source layout mesh (2,) on ranks [0, 1] (Shard(0)) does not hold rows [48, 64) "
        "(needed on destination ranks [3]); every source layout must hold the whole tensor"
    ):
        plan_rank(t, 0)


def test_shards_overlapping_within_a_layout():
    m = meta(shape=(64, 8))
    t = table([(m, Overlapping(Mesh.of([0, 1]), (Shard(0),)))], [(m, lay([0, 1, 2, 3], Shard(0)))])
    with raises(
        f"{W}: source rows [32, 34) are held twice within layout mesh (2,) on ranks [0, 1] (Shard(0)) "
        "(ranks [0, 1])"
    ):
        plan_rank(t, 0)


def test_tied_fallback_needs_its_source():
    t = table([(meta("x"), lay([0, 1], Shard(0)))], [(meta("output_layer.weight"), lay([2, 3], Shard(0)))])
    with raises(
        "output_layer.weight: on the destination only (ranks [2, 3]) and its tied source "
        "embedding.word_embeddings.weight is not on the source side either"
    ):
        plan_rank(t, 2, tied=True, ignore=["x"])


def test_tied_fallback_shape_must_agree():
    emb = meta("embedding.word_embeddings.weight", (8, 6))
    t = table(
        [(emb, lay([0, 1], Shard(0)))],
        [(emb, lay([2, 3], Shard(0))), (meta("output_layer.weight"), lay([2, 3], Shard(0)))],
    )
    with raises(
        "output_layer.weight: source (tied to embedding.word_embeddings.weight) shape (8, 6) float32 on "
        "ranks [0, 1] but destination shape (8, 4) float32 on ranks [2, 3]"
    ):
        plan_rank(t, 2, tied={"output_layer.weight": "embedding.word_embeddings.weight"})


def test_bad_batch_budget():
    t = table([(meta(), lay([0, 1], Shard(0)))], [(meta(), lay([2, 3], Shard(0)))])
    with pytest.raises(ValueError, match="^max_batch_bytes must be positive, got 0$"):
        plan_rank(t, 0, max_batch_bytes=0)
