"""Property tests: random shapes, meshes and placements; every rank planned; plans replayed in one process.

Source local tensors hold the global flat index of every element, so after replay each destination
element must equal its own global index (right source coordinate) and have been written exactly
once; the replay itself checks that the n-th send A→B matches the n-th receive on B from A.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import TableBuilder
from reshard_core.simulate.check import check_plans
from reshard_core.simulate.replay import replay
from reshard_core.specs import TensorMeta

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def compositions(draw, total: int):
    """A list of non-negative parts summing to ``total`` (Megatron partition_sizes × W)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=1, max_size=3)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


@st.composite
def placements(draw, shape: tuple[int, ...], mesh_ndim: int):
    out, first_cut = [], set()
    for _ in range(mesh_ndim):
        if not shape or draw(st.integers(0, 3)) == 0:
            out.append(Replicate())
            continue
        d = draw(st.integers(0, len(shape) - 1))
        kind = draw(st.sampled_from(["plain", "strided", "components"]))
        if kind == "strided":
            out.append(Shard(d, stride=draw(st.integers(2, 3))))
        elif kind == "components" and d not in first_cut:
            out.append(Shard(d, components=draw(compositions(shape[d]))))
        else:
            out.append(Shard(d))
        first_cut.add(d)
    return tuple(out)


@st.composite
def side(draw, shape: tuple[int, ...], pool: list[int]):
    """1–2 layouts (replica meshes) on disjoint slices of ``pool``."""
    layouts, at = [], 0
    for _ in range(draw(st.integers(1, 2))):
        mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        n = math.prod(mesh_shape)
        if at + n > len(pool):
            break
        mesh = Mesh(tuple(pool[at : at + n]), mesh_shape)
        layouts.append(Layout(mesh, draw(placements(shape, len(mesh_shape)))))
        at += n
    return layouts


@st.composite
def problems(draw):
    scalar = draw(st.integers(0, 19)) == 0
    shape = () if scalar else tuple(draw(st.lists(st.integers(0, 12), min_size=1, max_size=3)))
    world = 24
    src_pool = draw(st.permutations(range(world)))
    mode = draw(st.sampled_from(["overlapping", "disjoint", "same"]))
    if mode == "disjoint":
        dst_pool = [r + world for r in draw(st.permutations(range(world)))]
    elif mode == "same":
        dst_pool = list(src_pool)
    else:
        dst_pool = draw(st.permutations(range(world)))
    src = draw(side(shape, src_pool))
    dst = draw(side(shape, dst_pool))
    return shape, src, dst


def local_of(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    t = full
    for d, ivs in enumerate(layout.dim_intervals(tuple(full.shape), rank)):
        idx = [torch.arange(a, b) for a, b in ivs]
        t = t.index_select(d, torch.cat(idx) if idx else torch.empty(0, dtype=torch.long))
    return t


def build_and_replay(shape, src_layouts, dst_layouts, names=("w",), **plan_options):
    builder = TableBuilder()
    for name in names:
        meta = TensorMeta(name, shape, torch.float64)
        for side_name, layouts in (("src", src_layouts), ("dst", dst_layouts)):
            for lay in layouts:
                for r in lay.mesh.ranks:
                    builder.add(side_name, r, meta, lay)
    table = builder.build()
    ranks = sorted({r for lay in (*src_layouts, *dst_layouts) for r in lay.mesh.ranks})
    plans = {r: plan_rank(table, r, **plan_options) for r in ranks}
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    src, dst, want = {}, {}, {}
    for name in names:
        for lay in src_layouts:
            src.update({(r, name): local_of(full, lay, r) for r in lay.mesh.ranks})
        for lay in dst_layouts:
            want.update({(r, name): local_of(full, lay, r) for r in lay.mesh.ranks})
    dst = {k: torch.full_like(v, -1.0) for k, v in want.items()}
    counts = replay(plans, src, dst)
    for key, value in want.items():
        assert torch.equal(dst[key], value), f"rank {key[0]} got wrong values"
        assert bool((counts[key] == 1).all()), f"rank {key[0]}: an element not written exactly once"
    return table, plans


@SETTINGS
@given(problems())
def test_every_destination_element_exactly_once_from_its_source_coordinate(problem):
    shape, src, dst = problem
    table, plans = build_and_replay(shape, src, dst)
    report = check_plans(table, plans)
    assert report.valid, report.problems


@SETTINGS
@given(problems(), st.integers(1, 3000))
def test_batches_are_greedy_over_sorted_names_and_agree_on_both_ends(problem, budget):
    shape, src, dst = problem
    names = ("c", "a", "b")
    table, plans = build_and_replay(shape, src, dst, names=names, max_batch_bytes=budget)
    # weight = bytes × ceil(destination copies / source copies)
    nbytes = math.prod(shape) * 8
    ratio = -(-copies(dst) // copies(src))
    want, batch, used = {}, 0, 0
    for name in sorted(names):
        if used and used + nbytes * ratio > budget:
            batch, used = batch + 1, 0
        used += nbytes * ratio
        want[name] = batch
    assert {p.num_batches for p in plans.values()} == {batch + 1}
    for plan in plans.values():
        assert all(op.batch == want[op.name] for op in plan.ops)
    assert check_plans(table, plans).valid


def copies(layouts) -> int:
    total = 0
    for lay in layouts:
        total += math.prod(
            n for n, p in zip(lay.mesh.shape, lay.placements, strict=True) if isinstance(p, Replicate)
        )
    return total
