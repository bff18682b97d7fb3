"""swizzle_128x4 / unswizzle_128x4: the index formula of mxfp8.md A.5, round trips, zero padding."""

from __future__ import annotations

import pytest
import reshard_mxfp8 as mx
import torch


def _formula_offset(r: int, c: int, cols: int) -> int:
    return ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (384, 12)])
def test_swizzle_matches_index_formula_elementwise(shape: tuple[int, int]) -> None:
    rows, cols = shape
    s = torch.arange(rows * cols, dtype=torch.int32).view(rows, cols)
    flat = mx.swizzle_128x4(s)
    expected = torch.empty(rows * cols, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols):
            expected[_formula_offset(r, c, cols)] = s[r, c]
    assert torch.equal(flat, expected)


def test_round_trip_padded_scale() -> None:
    s = torch.randint(0, 256, (1152, 4), dtype=torch.int32).to(torch.uint8)
    flat = mx.swizzle_128x4(s)
    assert flat.dtype == torch.uint8 and flat.shape == (1152 * 4,)
    assert torch.equal(mx.unswizzle_128x4(flat, 1152, 4), s)


def test_unpadded_scale_is_zero_padded() -> None:
    s = torch.randint(1, 256, (1056, 3), dtype=torch.int32).to(torch.uint8)
    flat = mx.swizzle_128x4(s)
    assert flat.numel() == 1152 * 4
    assert torch.equal(mx.unswizzle_128x4(flat, 1056, 3), s)
    full = mx.unswizzle_128x4(flat, 1152, 4)
    assert not full[1056:].any() and not full[:, 3:].any()
    assert int((flat != 0).sum()) == 1056 * 3


def test_quantized_scales_round_trip_both_directions() -> None:
    x = torch.randn(1056, 96, dtype=torch.bfloat16)
    _, rs = mx.quantize(x)
    _, cs = mx.quantize(x, columnwise=True)
    assert torch.equal(mx.unswizzle_128x4(mx.swizzle_128x4(rs), *rs.shape), rs)
    ct = cs.t()  # TE swizzles columnwise scales transposed
    assert torch.equal(mx.unswizzle_128x4(mx.swizzle_128x4(ct), *ct.shape), ct)


def test_swizzle_errors() -> None:
    with pytest.raises(ValueError, match="2-D scale"):
        mx.swizzle_128x4(torch.zeros(512, dtype=torch.uint8))
    with pytest.raises(ValueError, match="128\\*4 = 512 elements"):
        mx.unswizzle_128x4(torch.zeros(256, dtype=torch.uint8), 100, 3)
    with pytest.raises(ValueError, match="non-negative"):
        mx.unswizzle_128x4(torch.zeros(0, dtype=torch.uint8), -1, 4)
