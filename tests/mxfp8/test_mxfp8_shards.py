"""Shard locality and in-place quantization of block-aligned boxes into persistent buffers."""

from __future__ import annotations

import itertools

import pytest
import reshard_mxfp8 as mx
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mxfp8_cases import random_tensor


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fill_boxes(
    x: torch.Tensor, cuts: list[list[int]], columnwise: bool, data: torch.Tensor, scale: torch.Tensor
) -> None:
    """quantize_into every box of the grid given by per-dim cut points."""
    for box in itertools.product(*[list(zip(c[:-1], c[1:], strict=True)) for c in cuts]):
        offsets = [a for a, _ in box]
        index = tuple(slice(a, b) for a, b in box)
        mx.quantize_into(x[index], data, scale, columnwise=columnwise, offsets=offsets)


def _persistent(shape: tuple[int, ...], columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    data, scale = mx.empty_quantized(shape, columnwise=columnwise)
    data.fill_(0xAA)  # stale bytes that must all be overwritten
    return data, scale, data.data_ptr(), scale.data_ptr()


@pytest.mark.parametrize("rows", [(0, 37), (37, 130), (130, 200), (5, 6)])
def test_rowwise_row_slice_equals_slice_of_full(rows: tuple[int, int]) -> None:
    x = random_tensor((200, 96), torch.bfloat16, seed=10)
    data, scale = mx.quantize(x)
    a, b = rows
    d, s = mx.quantize(x[a:b])
    assert torch.equal(d, data[a:b])
    assert torch.equal(s[: b - a, :3], scale[a:b, :3])


@pytest.mark.parametrize("rows", [(0, 64), (64, 160), (160, 192)])
def test_columnwise_aligned_row_slice_equals_slice_of_full(rows: tuple[int, int]) -> None:
    x = random_tensor((192, 96), torch.float32, seed=11)
    data, scale = mx.quantize(x, columnwise=True)
    a, b = rows
    d, s = mx.quantize(x[a:b], columnwise=True)
    assert torch.equal(d, data[a:b])
    assert torch.equal(s[: (b - a) // 32, :96], scale[a // 32 : b // 32, :96])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rowwise_boxes_into_persistent_buffers(dtype: torch.dtype) -> None:
    x = random_tensor((200, 96), dtype, seed=12)
    data, scale, dptr, sptr = _persistent(x.shape, False)
    _fill_boxes(x, [[0, 37, 200], [0, 32, 96]], False, data, scale)
    ref_d, ref_s = mx.quantize(x)
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)
    assert (data.data_ptr(), scale.data_ptr()) == (dptr, sptr)


def test_columnwise_boxes_into_persistent_buffers() -> None:
    x = random_tensor((192, 96), torch.bfloat16, seed=13)
    data, scale, dptr, sptr = _persistent(x.shape, True)
    _fill_boxes(x, [[0, 64, 192], [0, 5, 96]], True, data, scale)  # any column split is aligned
    ref_d, ref_s = mx.quantize(x, columnwise=True)
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)
    assert (data.data_ptr(), scale.data_ptr()) == (dptr, sptr)


def test_3d_boxes_with_partial_middle_dim_rowwise() -> None:
    x = random_tensor((4, 48, 64), torch.bfloat16, seed=14)
    data, scale, dptr, sptr = _persistent(x.shape, False)
    _fill_boxes(x, [[0, 2, 4], [0, 20, 48], [0, 32, 64]], False, data, scale)
    ref_d, ref_s = mx.quantize(x)
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)
    assert (data.data_ptr(), scale.data_ptr()) == (dptr, sptr)


def test_3d_boxes_columnwise() -> None:
    x = random_tensor((4, 48, 64), torch.float32, seed=15)
    data, scale, _, _ = _persistent(x.shape, True)
    _fill_boxes(x, [[0, 2, 4], [0, 48], [0, 10, 64]], True, data, scale)  # 2*48 rows = 3 blocks
    ref_d, ref_s = mx.quantize(x, columnwise=True)
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)


def test_full_write_zeroes_stale_scale_padding_in_place() -> None:
    x = random_tensor((40, 64), torch.bfloat16, seed=16)
    data = torch.empty(40, 64, dtype=torch.float8_e4m3fn)
    scale = torch.full(mx.scale_shape(x.shape), 0x5A, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    ptrs = (data.data_ptr(), scale.data_ptr())
    mx.quantize_into(x, data, scale)
    ref_d, ref_s = mx.quantize(x)
    assert torch.equal(_u8(data), ref_d) and torch.equal(_u8(scale), ref_s)
    assert (data.data_ptr(), scale.data_ptr()) == ptrs


def test_strided_input_box() -> None:
    big = random_tensor((64, 160), torch.bfloat16, seed=17)
    x = big[:, 32:128]  # non-contiguous view, odd-free storage offset
    data, scale = mx.empty_quantized(x.shape)
    mx.quantize_into(x, data, scale)
    ref_d, ref_s = mx.quantize(x.contiguous())
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)
    xt = big[:, :64].t()  # transposed view: quantized as its values, whatever the strides
    assert torch.equal(mx.quantize(xt)[0], mx.quantize(xt.contiguous())[0])


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 300),
    nb=st.integers(1, 6),
    row_cuts=st.lists(st.integers(0, 300), max_size=4),
    col_cuts=st.lists(st.integers(0, 6), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_any_aligned_partition_rebuilds_full_quantization(
    m: int, nb: int, row_cuts: list[int], col_cuts: list[int], seed: int
) -> None:
    k = 32 * nb
    x = random_tensor((m, k), torch.bfloat16, seed=seed)
    rows = sorted({0, m, *(c for c in row_cuts if c < m)})
    cols = sorted({0, k, *(32 * c for c in col_cuts if 32 * c < k)})
    data, scale, _, _ = _persistent(x.shape, False)
    _fill_boxes(x, [rows, cols], False, data, scale)
    ref_d, ref_s = mx.quantize(x)
    assert torch.equal(data, ref_d) and torch.equal(scale, ref_s)


def test_box_alignment_rules() -> None:
    assert mx.box_is_block_aligned((3, 32), (5, 64), (10, 96))
    assert not mx.box_is_block_aligned((3, 16), (5, 32), (10, 96))
    assert not mx.box_is_block_aligned((0, 0), (5, 48), (10, 96))
    assert mx.box_is_block_aligned((32, 7), (32, 5), (96, 96), columnwise=True)
    assert not mx.box_is_block_aligned((16, 0), (32, 96), (96, 96), columnwise=True)
    assert not mx.box_is_block_aligned((0, 1, 0), (2, 3, 64), (4, 48, 64), columnwise=True)
    assert mx.box_is_block_aligned((2, 0, 0), (2, 48, 64), (4, 48, 64), columnwise=True)
    assert mx.box_is_block_aligned((0, 0), (0, 7), (10, 96))
    with pytest.raises(ValueError, match="outside shape"):
        mx.box_is_block_aligned((8, 0), (5, 32), (10, 96))


def test_quantize_into_errors() -> None:
    x = torch.zeros(64, 96, dtype=torch.bfloat16)
    data, scale = mx.empty_quantized(x.shape)
    with pytest.raises(ValueError, match="not made of whole rowwise MXFP8 blocks"):
        mx.quantize_into(x[:, 16:48], data, scale, offsets=(0, 16))
    with pytest.raises(ValueError, match="not made of whole columnwise MXFP8 blocks"):
        cdata, cscale = mx.empty_quantized(x.shape, columnwise=True)
        mx.quantize_into(x[16:48], cdata, cscale, columnwise=True, offsets=(16, 0))
    with pytest.raises(ValueError, match="pass offsets"):
        mx.quantize_into(x[:32], data, scale)
    with pytest.raises(ValueError, match="must both have 2 dims"):
        mx.quantize_into(x[:32], data, scale, offsets=(0,))
    with pytest.raises(ValueError, match="outside shape"):
        mx.quantize_into(x[:32], data, scale, offsets=(40, 0))
    with pytest.raises(ValueError, match="too small"):
        mx.quantize_into(x, data, scale[:10])
    with pytest.raises(TypeError, match="data buffer must be uint8"):
        mx.quantize_into(x, data.to(torch.int8), scale)
    with pytest.raises(TypeError, match="scale buffer must be uint8"):
        mx.quantize_into(x, data, scale.float())
    with pytest.raises(TypeError, match="got torch.int64"):
        mx.quantize_into(torch.zeros(64, 96, dtype=torch.int64), data, scale)
