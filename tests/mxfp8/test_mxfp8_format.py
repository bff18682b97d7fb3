"""quantize / dequantize against the independent scalar oracle, byte for byte (compared as uint8)."""

from __future__ import annotations

import math

import mxfp8_oracle as oracle
import pytest
import reshard_mxfp8 as mx
import torch
from mxfp8_cases import edge_tensor, nan_case, random_tensor

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _valid(scale: torch.Tensor, shape: tuple[int, ...], columnwise: bool) -> torch.Tensor:
    rows, cols = mx.valid_scale_shape(shape, columnwise=columnwise)
    return scale[:rows, :cols]


def assert_matches_oracle(x: torch.Tensor, columnwise: bool) -> None:
    data, scale = mx.quantize(x, columnwise=columnwise)
    ref_data, ref_scale = oracle.quantize(x, columnwise=columnwise)
    assert data.dtype == torch.uint8 and data.shape == x.shape
    assert scale.dtype == torch.uint8 and tuple(scale.shape) == mx.scale_shape(x.shape, columnwise=columnwise)
    assert torch.equal(_valid(scale, tuple(x.shape), columnwise), ref_scale)
    diff = (data.reshape(ref_data.shape) != ref_data).nonzero()
    assert diff.numel() == 0, f"{len(diff)} data bytes differ, first at {diff[:3].tolist()}"
    padding = scale.clone()
    padding[: ref_scale.shape[0], : ref_scale.shape[1]] = 0
    assert not padding.any(), "scale padding must be zero"


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_data_matches_oracle(dtype: torch.dtype, columnwise: bool) -> None:
    # M = 96 and K = 160: neither a multiple of 128, so both scale paddings are exercised
    assert_matches_oracle(random_tensor((96, 160), dtype, seed=1), columnwise)


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_cases_match_oracle(dtype: torch.dtype, columnwise: bool) -> None:
    x = edge_tensor(dtype)  # rowwise blocks; its transpose puts the same blocks down the columns
    assert_matches_oracle(x.t().contiguous() if columnwise else x, columnwise)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bf16_amax_gets_te_scale(dtype: torch.dtype) -> None:
    """One block per positive bf16 value (all 32640 finite ones and inf) as the block's amax."""
    amax = torch.arange(0, 0x7F81, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dtype)
    if dtype == torch.float16:
        amax = amax[amax.isfinite()]  # many bf16 values overflow or underflow fp16; keep the rest
    x = torch.zeros(amax.numel(), 32, dtype=dtype)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    data, scale = mx.quantize(x)
    vals = oracle.element_values(amax)
    ref_e = [oracle.float_to_e8m0(oracle.f32(v * oracle.RCP_448)) for v in vals]
    assert torch.equal(scale[: len(vals), 0], torch.tensor(ref_e, dtype=torch.uint8))
    mults = [math.ldexp(1.0, 127 - e) for e in ref_e]
    ref_d = [oracle.to_e4m3(oracle.f32(v * m)) for v, m in zip(vals, mults, strict=True)]
    assert torch.equal(data[:, 0], torch.tensor(ref_d, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("shape", "columnwise"),
    [((5, 32), False), ((64, 32), True), ((1, 96), False), ((2, 48, 64), False), ((2, 48, 64), True)],
)
def test_small_and_nd_shapes_match_oracle(shape: tuple[int, ...], columnwise: bool) -> None:
    assert_matches_oracle(random_tensor(shape, torch.bfloat16, seed=2), columnwise)


def test_special_blocks() -> None:
    """The documented block rules: NaN ignored in amax, inf → scale 0xFE and 448, zero block → 0x00."""
    x = torch.zeros(4, 32)
    x[0, 0], x[0, 1] = float("nan"), 3.0
    x[1, 0], x[1, 1] = float("inf"), 3.0
    x[3, :] = float("nan")
    data, scale = mx.quantize(x)
    assert scale[:4, 0].tolist() == [oracle.float_to_e8m0(oracle.f32(3.0 * oracle.RCP_448)), 0xFE, 0x00, 0x00]
    assert data[0, 0].item() == 0x7F and data[1, 0].item() == 0x7E and data[1, 1].item() == 0
    assert not data[2].any() and (data[3] == 0x7F).all()


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_nan_is_0x7f_whatever_its_sign_and_payload(dtype: torch.dtype, columnwise: bool) -> None:
    """TE's NaN rule (CUDA gives it too: see test_mxfp8_gpu): NaN → 0x7F, left out of the block's amax."""
    x, ref_data, ref_scale = nan_case(dtype, columnwise)
    bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    assert bool((bits[x.isnan()] < 0).any()), "the case must hold negative NaNs"
    data, scale = mx.quantize(x, columnwise=columnwise)
    assert torch.equal(data, ref_data)
    assert torch.equal(_valid(scale, tuple(x.shape), columnwise), ref_scale)
    deq = mx.dequantize(data, scale, columnwise=columnwise, dtype=torch.float32)
    assert torch.equal(deq.isnan(), x.isnan())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_columnwise_is_rowwise_of_transpose(dtype: torch.dtype) -> None:
    x = random_tensor((160, 96), dtype, seed=3)
    data_c, scale_c = mx.quantize(x, columnwise=True)
    data_t, scale_t = mx.quantize(x.t().contiguous())
    assert torch.equal(data_c, data_t.t())
    assert torch.equal(_valid(scale_c, (160, 96), True), _valid(scale_t, (96, 160), False).t())


def test_padded_scale_shapes_and_zero_padding() -> None:
    x = random_tensor((1056, 96), torch.bfloat16, seed=4)
    x[0, 0] = float("nan")
    data_r, scale_r = mx.quantize(x)
    data_c, scale_c = mx.quantize(x, columnwise=True)
    assert tuple(scale_r.shape) == (1152, 4) and tuple(scale_c.shape) == (36, 128)
    assert mx.scale_shape((1056, 96)) == (1152, 4)
    assert mx.scale_shape((1056, 96), columnwise=True) == (36, 128)
    assert not scale_r[1056:].any() and not scale_r[:, 3:].any()
    assert not scale_c[33:].any() and not scale_c[:, 96:].any()


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_values_exact(dtype: torch.dtype, columnwise: bool) -> None:
    x = random_tensor((64, 96), dtype, seed=5)
    data, scale = mx.quantize(x, columnwise=columnwise)
    ref = oracle.dequantize_values(data, _valid(scale, (64, 96), columnwise), columnwise)
    out32 = mx.dequantize(data, scale, columnwise=columnwise, dtype=torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == x.shape
    ref_t = torch.tensor(ref, dtype=torch.float32).view(64, 96)
    assert torch.equal(out32.view(torch.int32), ref_t.view(torch.int32))
    out_bf16 = mx.dequantize(data, scale, columnwise=columnwise)
    assert torch.equal(out_bf16.view(torch.int16), out32.to(torch.bfloat16).view(torch.int16))


def test_dequantize_reads_only_valid_region() -> None:
    x = random_tensor((40, 64), torch.bfloat16, seed=6)
    data, scale = mx.quantize(x)
    garbage = scale.clone()
    garbage[40:] = 0xFF
    garbage[:, 2:] = 0xFF
    expected = mx.dequantize(data, scale)
    assert torch.equal(mx.dequantize(data, garbage).view(torch.int16), expected.view(torch.int16))
    compact = scale[:40, :2].clone()
    assert torch.equal(mx.dequantize(data, compact).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
def test_requantize_of_dequantized_gives_identical_values(columnwise: bool) -> None:
    x = random_tensor((256, 128), torch.bfloat16, seed=7)
    q = mx.quantize(x, columnwise=columnwise)
    v1 = mx.dequantize(*q, columnwise=columnwise, dtype=torch.float32)
    q2 = mx.quantize(mx.dequantize(*q, columnwise=columnwise), columnwise=columnwise)
    v2 = mx.dequantize(*q2, columnwise=columnwise, dtype=torch.float32)
    assert torch.equal(v1.view(torch.int32), v2.view(torch.int32))


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="at least 2 dims"):
        mx.quantize(torch.zeros(64))
    with pytest.raises(ValueError, match="last dim divisible by 32"):
        mx.quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="columnwise .* divisible by 32"):
        mx.quantize(torch.zeros(48, 32), columnwise=True)
    with pytest.raises(TypeError, match="got torch.float64"):
        mx.quantize(torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="got torch.int32"):
        mx.quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown MXFP8 backend"):
        mx.quantize(torch.zeros(4, 32), backend="cuda")
    with pytest.raises(RuntimeError, match="backend 'te'"):
        mx.quantize(torch.zeros(4, 32), backend="te")
    data, scale = mx.quantize(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="too small"):
        mx.dequantize(data, scale[:4, :1])
    with pytest.raises(TypeError, match="float64"):
        mx.dequantize(data, scale, dtype=torch.float64)
    with pytest.raises(TypeError, match="data must be uint8"):
        mx.dequantize(data.float(), scale)


def test_parameter_input_needs_no_grad_context() -> None:
    w = torch.nn.Parameter(random_tensor((64, 64), torch.float32, seed=8))
    data, scale = mx.quantize(w)
    assert not data.requires_grad and torch.equal(data, mx.quantize(w.detach())[0])
    assert not mx.dequantize(data, scale).requires_grad
    mx.quantize_into(w, data, scale)


def test_empty_tensor() -> None:
    data, scale = mx.quantize(torch.zeros(0, 64))
    assert data.shape == (0, 64) and tuple(scale.shape) == (0, 4)
    assert mx.dequantize(data, scale).shape == (0, 64)
