"""The chunked kernel: results must not depend on chunk / group sizes or on which amax path runs."""

from __future__ import annotations

import mxfp8_oracle as oracle
import pytest
import reshard_mxfp8 as mx
import torch
from mxfp8_cases import edge_tensor, random_tensor
from reshard_mxfp8 import kernels


def _with_nan_and_inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[-1, 0] = float("nan")  # lands in the last chunk of the last group
    x[x.shape[0] // 2, 33] = float("inf")
    return x


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "colwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_chunk_and_group_sizes_do_not_change_results(
    dtype: torch.dtype, columnwise: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _with_nan_and_inf(random_tensor((352, 96), dtype, seed=20))
    ref = oracle.quantize(x, columnwise=columnwise)
    monkeypatch.setattr(kernels, "_CPU_CHUNK_ELEMS", 96 * 40)  # 40 rows (32 for columnwise): ragged tails
    monkeypatch.setattr(kernels, "_CPU_GROUP_ELEMS", 96 * 100)
    data, scale = mx.quantize(x, columnwise=columnwise)
    rows, cols = mx.valid_scale_shape(x.shape, columnwise=columnwise)
    assert torch.equal(data, ref[0]) and torch.equal(scale[:rows, :cols], ref[1])


def test_bf16_pair_amax_equals_generic_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x = edge_tensor(torch.bfloat16)
    fast = mx.quantize(x)
    monkeypatch.setattr(kernels, "_bf16_pairs_ok", lambda t: False)
    slow = mx.quantize(x)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_odd_storage_offset_uses_generic_path() -> None:
    x = random_tensor((64, 96), torch.bfloat16, seed=21)
    store = torch.empty(1 + x.numel(), dtype=torch.bfloat16)
    shifted = store[1:].view(64, 96)
    shifted.copy_(x)
    assert not kernels._bf16_pairs_ok(shifted)
    a, b = mx.quantize(shifted), mx.quantize(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_clamping_fallback_for_non_saturating_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older torch casts overflow to NaN; the kernel then clamps to ±448 first, with the same bytes."""
    x = edge_tensor(torch.float32)
    ref = mx.quantize(x)
    monkeypatch.setattr(kernels, "_cast_saturates", lambda device_type: False)
    got = mx.quantize(x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
