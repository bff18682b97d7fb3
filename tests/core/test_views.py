"""Split views: logical boxes over grouped strided views (Megatron's group-interleaved QKV)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from reshard_core.views import SplitRegion, SplitView, copy_into, flat_blocks, materialize


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
