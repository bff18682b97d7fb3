"""Layout model: torch.chunk semantics, strides, components, stacked shards, boxes."""

from __future__ import annotations

import pytest
import torch

from reshard_core.layout import Box, Layout, Mesh, Replicate, Shard, chunk_bounds, take_intervals


def test_chunk_bounds_follow_torch_chunk_including_empty_trailing_shards():
    for length in range(0, 12):
        for pieces in range(1, 6):
            chunks = torch.arange(length).chunk(pieces) if length else ()
            sizes = [c.numel() for c in chunks] + [0] * (pieces - len(chunks))
            got = [chunk_bounds(length, pieces, i) for i in range(pieces)]
            assert [b - a for a, b in got] == sizes
            assert all(a <= b for a, b in got)


def test_uneven_shard_with_an_empty_last_rank():
    layout = Layout(Mesh.of(range(4)), (Shard(0),))
    assert [layout.dim_intervals((5, 2), r)[0] for r in range(4)] == [
        ((0, 2),),
        ((2, 4),),
        ((4, 5),),
        (),
    ]
    assert layout.boxes((5, 2), 3) == ()
    assert layout.local_shape((5, 2), 3) == (0, 2)


def test_stride_is_megatron_partition_stride():
    layout = Layout(Mesh.of([0, 1]), (Shard(0, stride=2),))
    assert layout.dim_intervals((16,), 0) == (((0, 4), (8, 12)),)
    assert layout.boxes((16,), 1) == (Box((4,), (4,), (0,)), Box((12,), (4,), (4,)))


def test_components_are_split_on_their_own():
    layout = Layout(Mesh.of([0, 1]), (Shard(0, components=(4, 2)),))
    assert layout.dim_intervals((6,), 0) == (((0, 2), (4, 5)),)
    assert layout.dim_intervals((6,), 1) == (((2, 4), (5, 6)),)


def test_explicit_sizes_split_unevenly_past_torch_chunk():
    # a 1000-row vocab padded to 4 x 256 rows: the last rank holds 232 real rows
    layout = Layout(Mesh.of(range(4)), (Shard(0, sizes=(256, 256, 256, 232)),))
    assert [layout.dim_intervals((1000, 8), r)[0] for r in range(4)] == [
        ((0, 256),), ((256, 512),), ((512, 768),), ((768, 1000),),
    ]  # fmt: skip
    # vLLM's linear expert placement: 6 experts over 4 ranks -> 2, 2, 1, 1 (torch.chunk: 2, 2, 2, 0)
    experts = Layout(Mesh.of(range(4)), (Shard(0, sizes=(2, 2, 1, 1)),))
    assert [experts.local_shape((6, 3), r) for r in range(4)] == [(2, 3), (2, 3), (1, 3), (1, 3)]


def test_explicit_sizes_must_fit_the_mesh_and_the_extent():
    with pytest.raises(ValueError, match=r"3 sizes for a mesh dim of 4 ranks"):
        Layout(Mesh.of(range(4)), (Shard(0, sizes=(1, 1, 1)),)).boxes((3,), 0)
    with pytest.raises(ValueError, match=r"sizes sum to 4, extent is 5"):
        Layout(Mesh.of(range(4)), (Shard(0, sizes=(1, 1, 1, 1)),)).boxes((5,), 0)
    with pytest.raises(ValueError, match="Shard takes one of stride, components or sizes"):
        Shard(0, stride=2, sizes=(1, 1))


def test_two_mesh_dims_on_one_tensor_dim_cut_left_to_right():
    # FSDP-style Shard(0) of a TP-local extent: TP first (mesh dim 0), then FSDP cuts the local rows
    layout = Layout(Mesh((0, 1, 2, 3), (2, 2)), (Shard(0), Shard(0)))
    assert [layout.dim_intervals((8,), r)[0] for r in range(4)] == [
        ((0, 2),),
        ((2, 4),),
        ((4, 6),),
        ((6, 8),),
    ]
    strided = Layout(Mesh((0, 1, 2, 3), (2, 2)), (Shard(0, stride=2), Shard(0)))
    assert strided.dim_intervals((16,), 1) == (((8, 12),),)
    assert strided.dim_intervals((16,), 0) == (((0, 4),),)


def test_replicate_and_rank_outside_mesh():
    layout = Layout(Mesh((4, 5), (2,)), (Replicate(),))
    assert layout.boxes((3,), 5) == (Box((0,), (3,), (0,)),)
    assert layout.boxes((3,), 0) == ()
    assert layout.dim_intervals((3,), 0) is None


def test_take_intervals_maps_local_positions_to_global_ranges():
    assert take_intervals(((0, 4), (8, 12)), 2, 6) == [(2, 4), (8, 10)]
    assert take_intervals(((0, 4), (8, 12)), 4, 8) == [(8, 12)]
