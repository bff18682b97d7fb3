"""GPU checks (mxfp8.md A.8): the pure path on CUDA, Transformer Engine and FlashInfer against the reference.

Everything here is marked ``gpu`` (skipped without CUDA). TE and FlashInfer parts also skip when the
library is not importable or the GPU is older than Blackwell (their MXFP8 kernels need SM100+).
"""

from __future__ import annotations

import collections

import pytest
import reshard_mxfp8 as mx
import torch
from mxfp8_cases import edge_tensor, nan_case, random_tensor

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def _te():
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except Exception:
        return None
    return MXFP8Quantizer, tex


def _flashinfer():
    try:
        import flashinfer
    except Exception:
        return None
    return flashinfer


needs_te = pytest.mark.skipif(_te() is None or not _blackwell(), reason="needs transformer_engine on SM100+")
needs_fi = pytest.mark.skipif(_flashinfer() is None or not _blackwell(), reason="needs flashinfer on SM100+")


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Edge blocks (M not a multiple of 128), random data over many binades, NaNs of both signs."""
    nans = nan_case(dtype, columnwise=True)[0]  # [32, 32]: TE can quantize it both ways
    return [edge_tensor(dtype), random_tensor((1056, 96), dtype, seed=30), nans]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal fp32 values, any NaN equal to any NaN (its bits depend on the device)."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _valid(scale: torch.Tensor, shape: tuple[int, ...], columnwise: bool) -> torch.Tensor:
    rows, cols = mx.valid_scale_shape(shape, columnwise=columnwise)
    return scale[:rows, :cols]


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pure_path_on_cuda_equals_cpu(dtype: torch.dtype, columnwise: bool) -> None:
    for x in _inputs(dtype):
        cpu = mx.quantize(x, columnwise=columnwise, backend="torch")
        gpu = mx.quantize(x.cuda(), columnwise=columnwise, backend="torch")
        assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])
        deq = mx.dequantize(*gpu, columnwise=columnwise, dtype=torch.float32).cpu()
        ref = mx.dequantize(*cpu, columnwise=columnwise, dtype=torch.float32)
        assert _same_values(deq, ref)


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_rule_on_cuda(dtype: torch.dtype, columnwise: bool) -> None:
    """The CPU test's exact bytes on CUDA: every NaN → 0x7F, NaN left out of the block's amax."""
    x, ref_data, ref_scale = nan_case(dtype, columnwise)
    data, scale = mx.quantize(x.cuda(), columnwise=columnwise, backend="torch")
    assert torch.equal(data.cpu(), ref_data)
    assert torch.equal(_valid(scale.cpu(), tuple(x.shape), columnwise), ref_scale)
    deq = mx.dequantize(data, scale, columnwise=columnwise, dtype=torch.float32).cpu()
    assert torch.equal(deq.isnan(), x.isnan())


def test_quantize_into_on_cuda_keeps_pointers() -> None:
    x = random_tensor((200, 96), torch.bfloat16, seed=31).cuda()
    data, scale = mx.empty_quantized(x.shape, device="cuda")
    ptrs = (data.data_ptr(), scale.data_ptr())
    mx.quantize_into(x[:37], data, scale, offsets=(0, 0))
    mx.quantize_into(x[37:], data, scale, offsets=(37, 0))
    ref = mx.quantize(x.cpu())
    assert torch.equal(data.cpu(), ref[0]) and torch.equal(scale.cpu(), ref[1])
    assert (data.data_ptr(), scale.data_ptr()) == ptrs


@needs_te
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transformer_engine_matches_reference(dtype: torch.dtype) -> None:
    quantizer_cls, tex = _te()
    for x in _inputs(dtype):
        q = quantizer_cls(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)(x.cuda())
        for columnwise, data, scale in (
            (False, q._rowwise_data, q._rowwise_scale_inv),
            (True, q._columnwise_data, q._columnwise_scale_inv),
        ):
            ref_d, ref_s = mx.quantize(x, columnwise=columnwise, backend="torch")
            assert torch.equal(data.view(torch.uint8).cpu().view(x.shape), ref_d)
            got_s = _valid(scale.view(torch.uint8).cpu(), tuple(x.shape), columnwise)
            assert torch.equal(got_s, _valid(ref_s, tuple(x.shape), columnwise))
        deq = q.dequantize(dtype=torch.float32).cpu()
        ref = mx.dequantize(*mx.quantize(x, backend="torch"), dtype=torch.float32)
        assert _same_values(deq, ref)


@needs_te
def test_te_backend_dispatch_equals_pure_path() -> None:
    x = random_tensor((256, 128), torch.bfloat16, seed=32).cuda()
    for columnwise in (False, True):
        te_q = mx.quantize(x, columnwise=columnwise, backend="te")
        ref = mx.quantize(x, columnwise=columnwise, backend="torch")
        assert torch.equal(te_q[0], ref[0]) and torch.equal(te_q[1], ref[1])


@needs_te
def test_te_gemm_swizzled_scales_match_swizzle_128x4() -> None:
    quantizer_cls, tex = _te()
    quantizer = quantizer_cls(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    if not hasattr(quantizer, "optimize_for_gemm"):
        pytest.skip("this TE has no optimize_for_gemm")
    quantizer.optimize_for_gemm = True
    x = random_tensor((1056, 96), torch.bfloat16, seed=33)
    q = quantizer(x.cuda())
    ref_d, ref_s = mx.quantize(x, backend="torch")
    got = q._rowwise_scale_inv.view(torch.uint8).reshape(-1).cpu()
    assert torch.equal(got, mx.swizzle_128x4(ref_s))


@needs_fi
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flashinfer_quantize_against_reference(dtype: torch.dtype) -> None:
    """Random data must match exactly; edge blocks may differ (rcp.approx, NaN clamp) and are reported."""
    fi = _flashinfer()
    for i, x in enumerate(_inputs(dtype)):
        ref_d, ref_s = mx.quantize(x, backend="torch")
        m, k = x.shape
        xq, sf = fi.mxfp8_quantize(x.cuda(), is_sf_swizzled_layout=False)
        got_d = xq.view(torch.uint8).cpu()[:, :k]
        got_s = sf.view(torch.uint8).cpu().view(m, k // 32)
        xq_sw, sf_sw = fi.mxfp8_quantize(x.cuda(), is_sf_swizzled_layout=True)
        swizzled_equal = torch.equal(sf_sw.view(torch.uint8).cpu().reshape(-1), mx.swizzle_128x4(ref_s))
        if i == 1:  # random data
            assert torch.equal(got_d, ref_d) and torch.equal(got_s, ref_s[:m, : k // 32])
            assert swizzled_equal
            continue
        blocks = (got_s != ref_s[:m, : k // 32]).nonzero().tolist()
        categories = collections.Counter()
        for r, b in blocks:
            block = x[r, b * 32 : (b + 1) * 32].float()
            if block.isnan().any():
                categories["nan block"] += 1
            elif block.abs().max() < 2.0**-100:
                categories["tiny block"] += 1
            else:
                categories["amax boundary"] += 1
        print(f"flashinfer {dtype} edge blocks with a different scale byte: {dict(categories)}")


@needs_fi
def test_flashinfer_mm_mxfp8_end_to_end() -> None:
    fi = _flashinfer()
    g = torch.Generator().manual_seed(34)
    a = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(256, 256, generator=g).to(torch.bfloat16)
    a_d, a_s = mx.quantize(a)
    w_d, w_s = mx.quantize(w)
    out = fi.mm_mxfp8(
        a_d.cuda().view(torch.float8_e4m3fn),
        w_d.cuda().view(torch.float8_e4m3fn).t(),
        mx.swizzle_128x4(a_s).cuda(),
        mx.swizzle_128x4(w_s).cuda(),
        out_dtype=torch.bfloat16,  # mm_mxfp8 accepts bf16/fp16 outputs only
    )
    ref = mx.dequantize(a_d, a_s, dtype=torch.float32) @ mx.dequantize(w_d, w_s, dtype=torch.float32).T
    # the bf16 output rounds the fp32 accumulation: 2**-8 relative
    torch.testing.assert_close(
        out.cpu().float(), ref.to(torch.bfloat16).float(), rtol=2**-7, atol=ref.abs().max().item() * 2**-8
    )
