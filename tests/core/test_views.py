"""Split and piecewise views: logical boxes over grouped strided views (Megatron's group-interleaved QKV)
and over stretches of a parameter, possibly stored with an offset (Qwen3-Next's delta-net in Megatron)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reshard_core.views import PiecewiseView, SplitRegion, SplitView, copy_into, flat_blocks, materialize


def test_flat_blocks_cover_a_row_major_range_in_order():
    sizes = (2, 3, 4)
    for start in range(25):
        for stop in range(start, 25):
            blocks = flat_blocks(sizes, start, stop)
            assert len(blocks) <= 2 * len(sizes) - 1
            flat: list[int] = []
            for offset, block in blocks:
                assert offset == len(flat)
                flat += [
                    i * 12 + j * 4 + k for i, j, k in itertools.product(*(range(a, b) for a, b in block))
                ]
            assert flat == list(range(start, stop))


def _qkv_like(groups=3, block=7, take=4, hidden=5):
    physical = torch.arange(groups * block * hidden, dtype=torch.float32).view(groups * block, hidden)
    base = physical.view(groups, block, hidden)[:, 1 : 1 + take]  # rows 1..take of every group
    return physical, base, SplitView(base, ((groups, take), (hidden,)))


def test_regions_read_and_write_the_grouped_rows_exactly():
    rng = random.Random(0)
    _, base, view = _qkv_like()
    assert tuple(view.shape) == (12, 5) and view.dim() == 2
    for _ in range(300):
        a = rng.randrange(12)
        b = rng.randrange(a, 13)
        x = rng.randrange(5)
        y = rng.randrange(x, 6)
        part = view.region((a, x), (b - a, y - x))
        assert torch.equal(materialize(part), base.reshape(12, 5)[a:b, x:y])
        fresh = torch.randn(b - a, y - x)
        copy_into(part, fresh)
        assert torch.equal(base.reshape(12, 5)[a:b, x:y], fresh)
        back = torch.empty(b - a, y - x)
        copy_into(back, part)
        assert torch.equal(back, fresh)


def test_a_region_inside_one_block_is_a_plain_view_and_writes_leave_other_rows_alone():
    physical, _, view = _qkv_like()
    before = physical.clone()
    inside = view.region((4, 0), (4, 5))  # exactly group 1's rows
    assert isinstance(inside, torch.Tensor)
    across = view.region((2, 0), (4, 5))  # the end of group 0 and the start of group 1
    assert isinstance(across, SplitRegion) and len(across.pieces) == 2
    copy_into(across, torch.full((4, 5), -1.0))
    changed = (physical != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 4, 8, 9]  # rows 3, 4 of group 0 and rows 1, 2 of group 1 (block of 7)


def test_two_split_regions_copy_through_one_buffer():
    _, base_a, a = _qkv_like()
    _, base_b, b = _qkv_like(groups=2, block=9, take=6)
    base_b.zero_()
    copy_into(b.region((1, 1), (10, 3)), a.region((2, 0), (10, 3)))
    assert torch.equal(base_b.reshape(12, 5)[1:11, 1:4], base_a.reshape(12, 5)[2:12, 0:3])


def test_base_must_match_its_groups():
    with pytest.raises(ValueError, match=r"base shape \(3, 4, 5\) is not the groups \(\(3, 5\), \(5,\)\)"):
        SplitView(torch.zeros(3, 4, 5), ((3, 5), (5,)))


def _stretches():
    """A [10, 3] parameter whose rows 6..9, then 0..2 (so ordered) make a [7, 3] piecewise view."""
    physical = torch.arange(30, dtype=torch.float32).view(10, 3)
    view = PiecewiseView([(4, physical[0:3]), (0, physical[6:10])])
    return physical, view, torch.cat([physical[6:10], physical[0:3]])


def test_piecewise_regions_read_and_write_the_stretches_exactly():
    rng = random.Random(1)
    physical, view, logical = _stretches()
    assert tuple(view.shape) == (7, 3) and view.dim() == 2 and view.numel() == 21
    assert torch.equal(materialize(view.region((0, 0), (7, 3))), logical)
    for _ in range(200):
        a, c = rng.randrange(7), rng.randrange(3)
        b, d = rng.randrange(a + 1, 8), rng.randrange(c + 1, 4)
        assert torch.equal(materialize(view.region((a, c), (b - a, d - c))), logical[a:b, c:d])
        fresh = torch.randn(b - a, d - c)
        before = physical.clone()
        copy_into(view.region((a, c), (b - a, d - c)), fresh)
        logical[a:b, c:d] = fresh
        assert torch.equal(torch.cat([physical[6:10], physical[0:3]]), logical)
        assert torch.equal(physical[3:6], before[3:6])  # rows outside the stretches are never written


def test_a_piecewise_region_in_one_stretch_is_a_plain_view():
    physical, view, _ = _stretches()
    inside = view.region((4, 1), (2, 2))
    assert isinstance(inside, torch.Tensor) and inside.data_ptr() == physical[0, 1].data_ptr()


def test_an_offset_is_added_when_read_and_subtracted_when_written():
    stored = torch.tensor([-0.5, 0.0, 0.25, 1.0])  # a zero-centred norm kept as w - 1
    view = PiecewiseView([(0, stored)], offset=1.0)
    region = view.region((1,), (2,))
    assert isinstance(region, SplitRegion) and region.offset == 1.0
    assert torch.equal(materialize(view.region((0,), (4,))), torch.tensor([0.5, 1.0, 1.25, 2.0]))
    copy_into(view.region((1,), (3,)), torch.tensor([1.5, 0.75, 2.0], dtype=torch.bfloat16))
    assert torch.equal(stored, torch.tensor([-0.5, 0.5, -0.25, 1.0]))


def test_parts_must_tile_the_dim():
    t = torch.zeros(6, 2)
    with pytest.raises(ValueError, match="do not tile dim 0"):
        PiecewiseView([(0, t[0:2]), (3, t[2:4])])
