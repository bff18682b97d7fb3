"""DTensor extraction: FSDP2 (uneven), HSDP, parallelize_module TP, FSDP2 + TP (_StridedShard), errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard_core.extract import ExtractError
from reshard_core.extract.dtensor import dtensor_layout
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.testing.world import run_world

WORLD = 4


def fake_mesh(*shape):
    return SimpleNamespace(mesh=torch.arange(8, 8 + int(torch.tensor(shape).prod())).reshape(shape))


def test_placements_map_to_a_layout_over_global_ranks():
    layout = dtensor_layout("w", (6, 4), fake_mesh(2, 2), (DReplicate(), DShard(1)))
    assert layout == Layout(Mesh((8, 9, 10, 11), (2, 2)), (Replicate(), Shard(1)))


def test_strided_shard_moves_its_mesh_dim_behind_the_dims_it_waits_for():
    placements = (DReplicate(), _StridedShard(0, split_factor=2), DShard(0))
    layout = dtensor_layout("w", (10, 4), fake_mesh(2, 2, 2), placements)
    swapped = Mesh((8, 10, 9, 11, 12, 14, 13, 15), (2, 2, 2))  # mesh dims 1 and 2 swapped
    assert layout == Layout(swapped, (Replicate(), Shard(0), Shard(0)))


def test_strided_shard_no_order_explains_is_read_on_its_own():
    """torch cuts the extent into split_factor chunks, then each chunk over the mesh dim (torch.chunk
    both times): a stride when that is even, else components of the chunk sizes."""
    layout = dtensor_layout("w", (12, 4), fake_mesh(2), (_StridedShard(0, split_factor=3),))
    assert layout == Layout(Mesh((8, 9), (2,)), (Shard(0, stride=3),))
    layout = dtensor_layout("w", (10, 4), fake_mesh(2), (_StridedShard(0, split_factor=3),))
    assert layout == Layout(Mesh((8, 9), (2,)), (Shard(0, components=(4, 4, 2)),))
    assert layout.dim_intervals((10, 4), 8)[0] == ((0, 2), (4, 6), (8, 9))


def test_strided_shard_is_decoded_into_a_shard_order_as_torch_does():
    """(_S(0, 2), S(0), S(0)) on a 2x2x2 mesh: torch orders mesh dims 1, 0, 2 (dim 0's split factor 2
    is the size of mesh dim 1 alone), however uneven the rows."""
    placements = (_StridedShard(0, split_factor=2), DShard(0), DShard(0))
    layout = dtensor_layout("w", (7, 4), fake_mesh(2, 2, 2), placements)
    swapped = Mesh((8, 9, 12, 13, 10, 11, 14, 15), (2, 2, 2))  # mesh dims 0 and 1 swapped
    assert layout == Layout(swapped, (Shard(0), Shard(0), Shard(0)))


def test_use_strided_shard_as_shard_order_decides_how_strided_shards_read():
    """False: each _StridedShard on its own, in the spec's shard_order; True: the split factors give the
    order and torch ignores any shard_order on the spec."""
    placements = (_StridedShard(0, split_factor=2), DShard(0))
    flag_false = dtensor_layout("w", (7, 4), fake_mesh(2, 2), placements, None, False)
    assert flag_false == Layout(Mesh((8, 9, 10, 11), (2, 2)), (Shard(0, components=(4, 3)), Shard(0)))
    bogus = (SimpleNamespace(tensor_dim=0, mesh_dims=(0, 1)),)
    flag_true = dtensor_layout("w", (7, 4), fake_mesh(2, 2), placements, bogus, True)
    assert flag_true == Layout(Mesh((8, 10, 9, 11), (2, 2)), (Shard(0), Shard(0)))


def test_partial_placement_is_refused():
    with pytest.raises(ExtractError) as info:
        dtensor_layout("acc", (4,), fake_mesh(2), (Partial(),))
    assert str(info.value) == (
        "tensor 'acc': placement Partial(sum) is Partial (pending reduction); reduce it "
        "(e.g. redistribute to Replicate) before resharding"
    )


# ---------------------------------------------------------------- a real 4-rank world


def _region(t, offsets, sizes):
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def _exact(spec, full, rank) -> bool:
    """Every box of ``rank`` reads, from its local tensor, exactly that region of ``full``."""
    boxes = spec.layout.boxes(spec.meta.shape, rank)
    return all(torch.equal(_region(spec.tensor, b.local_offsets, b.sizes), _region(full, b.offsets, b.sizes))
               for b in boxes)  # fmt: skip


def _dtensor_world(rank: int, world: int):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from reshard_core.extract import extract_specs
    from reshard_core.testing.models import build_fsdp_mlp, build_tp_mlp

    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    builders = {
        "fsdp": lambda: build_fsdp_mlp(seed=1),  # fc1.weight (33, 64) over 4: 9, 9, 9, 6 rows
        "hsdp": lambda: build_fsdp_mlp(grid, seed=1),  # (33, 64) sharded over 2: 17, 16 rows
        "tp": lambda: build_tp_mlp(flat, seed=2, ffn=30),  # colwise 8, 8, 8, 6 rows
        "fsdp_tp": lambda: build_tp_mlp(grid["tp"], fsdp_mesh=grid["dp"], seed=3, ffn=96),
        "fsdp_tp_uneven": lambda: build_tp_mlp(grid["tp"], fsdp_mesh=grid["dp"], seed=3, ffn=10),
    }
    out = {}
    for key, build in builders.items():
        model = build()
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        rows = []
        for s in extract_specs(model, "src"):
            t = tensors[s.meta.name]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            exact = _exact(s, full, rank)
            same = s.tensor is (t._local_tensor if isinstance(t, DTensor) else t)
            rows.append((s.meta.name, s.meta.shape, s.layout, tuple(s.tensor.shape), exact, same))
        out[key] = rows
    holder = nn.Module()
    holder.register_buffer("acc", DTensor.from_local(torch.ones(2), flat, [Partial()]))
    try:
        extract_specs(holder, "src")
    except ExtractError as exc:
        out["partial"] = str(exc)
    holder = nn.Module()
    strided = distribute_tensor(torch.arange(24.0).reshape(12, 2), flat, [_StridedShard(0, split_factor=3)])
    holder.register_buffer("w", strided)
    (spec,) = extract_specs(holder, "dst")
    boxes = spec.layout.boxes((12, 2), rank)
    out["strided"] = (spec.layout, len(boxes), _exact(spec, strided.full_tensor(), rank))
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_dtensor_world, WORLD)


def _rows(results, key, name):
    return [next(row for row in out[key] if row[0] == name) for out in results]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fsdp", "hsdp", "tp", "fsdp_tp", "fsdp_tp_uneven"])
def test_every_box_equals_full_tensor_and_spec_tensor_is_the_local_tensor(results, key):
    for out in results:
        names = [row[0] for row in out[key]]
        assert names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"]
        for name, *_, exact, same in out[key]:
            assert exact and same, (key, name)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "scale"):
        assert len({row[2] for row in _rows(results, key, name)}) == 1, (key, name)  # one layout per mesh


ALL4 = Mesh((0, 1, 2, 3), (4,))
GRID = Mesh((0, 1, 2, 3), (2, 2))
TP_FIRST = Mesh((0, 2, 1, 3), (2, 2))  # the grid with its (dp, tp) dims swapped


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "name", "shape", "layout", "local_rows"),
    [
        ("fsdp", "fc1.weight", (33, 64), Layout(ALL4, (Shard(0),)), [9, 9, 9, 6]),
        ("fsdp", "scale", (64,), Layout(ALL4, (Replicate(),)), [64] * 4),
        ("hsdp", "fc1.weight", (33, 64), Layout(GRID, (Replicate(), Shard(0))), [17, 16, 17, 16]),
        ("hsdp", "fc1.bias", (33,), Layout(GRID, (Replicate(), Shard(0))), [17, 16, 17, 16]),
        ("tp", "fc1.weight", (30, 64), Layout(ALL4, (Shard(0),)), [8, 8, 8, 6]),
        ("tp", "fc2.weight", (64, 30), Layout(ALL4, (Shard(1),)), [64] * 4),
        ("tp", "fc2.bias", (64,), Layout(ALL4, (Replicate(),)), [64] * 4),
        ("fsdp_tp", "fc1.weight", (96, 64), Layout(TP_FIRST, (Shard(0), Shard(0))), [24] * 4),
        ("fsdp_tp", "fc2.weight", (64, 96), Layout(GRID, (Shard(0), Shard(1))), [32] * 4),
        ("fsdp_tp_uneven", "fc1.weight", (10, 64), Layout(TP_FIRST, (Shard(0), Shard(0))), [3, 3, 2, 2]),
    ],
)
def test_exact_layouts_and_local_shapes(results, key, name, shape, layout, local_rows):
    rows = _rows(results, key, name)
    assert [(r[1], r[2]) for r in rows] == [(shape, layout)] * WORLD
    assert [r[3][0] for r in rows] == local_rows


@pytest.mark.slow
def test_partial_dtensor_in_a_model_is_refused(results):
    assert [out["partial"] for out in results] == [
        "tensor 'acc': placement Partial(sum) is Partial (pending reduction); reduce it "
        "(e.g. redistribute to Replicate) before resharding"
    ] * WORLD


@pytest.mark.slow
def test_even_strided_shard_distributed_by_torch_matches_its_stride_layout(results):
    for out in results:
        assert out["strided"] == (Layout(ALL4, (Shard(0, stride=3),)), 3, True)
