"""MXFP8 (E4M3 elements, E8M0 scale per 32 elements) quantize / dequantize, bit-exact with Transformer Engine.

Buffers follow TE's ``MXFP8Tensor`` layout: data is uint8 in the tensor's own shape, scales are uint8 E8M0
bytes in a padded 2-D array (see ``layout.py``) whose padding is zero. ``quantize_into`` writes into
preallocated (persistent) buffers, also for a block-aligned box of the weight, so received slices can be
quantized in place: rowwise quantization of a slice equals the same slice of the full quantization.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import accel
from .e8m0 import e8m0_to_float
from .kernels import quantize_2d
from .layout import (
    BLOCK,
    box_is_block_aligned,
    check_dtype,
    check_input,
    check_shape,
    flat_rows,
    scale_shape,
    valid_scale_shape,
)

_DATA_DTYPES = (torch.uint8, torch.float8_e4m3fn)
_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def empty_quantized(
    shape: Sequence[int], *, columnwise: bool = False, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``(data, scale)`` buffers for a tensor of ``shape``: data uninitialised, scale all zero."""
    shape = tuple(shape)
    data = torch.empty(shape, dtype=torch.uint8, device=device)
    scale = torch.zeros(scale_shape(shape, columnwise=columnwise), dtype=torch.uint8, device=device)
    return data, scale


@torch.no_grad()
def quantize(
    x: torch.Tensor, *, columnwise: bool = False, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16/fp16/fp32, ndim ≥ 2, last dim % 32 == 0) to MXFP8 E4M3 as TE does.

    Returns ``(data, scale)``: uint8 data in ``x``'s shape and uint8 E8M0 scales of shape
    ``[roundup(M,128), roundup(K/32,4)]`` (rowwise, 1x32 blocks) or ``[roundup(M/32,4), roundup(K,128)]``
    (``columnwise=True``, 32x1 blocks; needs M % 32 == 0), M = prod(shape[:-1]), padding zero.
    Special values, as TE: NaN is left out of a block's amax (an all-NaN block gets scale 0x00) and every
    NaN element becomes data byte 0x7F whatever its sign or payload; ±inf saturates to ±448.
    ``backend``: ``"torch"`` (the pure reference, any device), ``"te"`` (Transformer Engine's kernel,
    CUDA only) or ``"auto"`` (TE when it is importable and usable for ``x``, else torch).
    """
    check_input(x, columnwise=columnwise)
    if accel.choose_backend(x, backend, columnwise=columnwise) == "te":
        return accel.te_quantize(x, columnwise=columnwise)
    data, scale = empty_quantized(x.shape, columnwise=columnwise, device=x.device)
    _quantize_box(x, data, scale, (0,) * x.dim(), columnwise)
    return data, scale


@torch.no_grad()
def quantize_into(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    columnwise: bool = False,
    offsets: Sequence[int] | None = None,
) -> None:
    """Quantize ``x`` in place into persistent ``data`` / ``scale`` buffers of the full tensor.

    ``data`` (uint8 or float8_e4m3fn) has the full tensor's shape; ``scale`` (uint8 or float8_e8m0fnu)
    is 2-D and at least the valid scale region (normally the padded TE shape). Storage is never
    reallocated. With ``offsets=None``, ``x`` is the whole tensor and scale entries outside the valid
    region are zeroed. Otherwise ``x`` is the box of the full tensor starting at ``offsets`` (one per dim,
    sizes ``x.shape``); only that box's data and the scales of its blocks are written, and the box must
    be made of whole blocks (``box_is_block_aligned``).
    """
    check_dtype(x)
    full = tuple(data.shape)
    if data.dtype not in _DATA_DTYPES:
        raise TypeError(f"data buffer must be uint8 or float8_e4m3fn, got {data.dtype}")
    if scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"scale buffer must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    if x.device != data.device or x.device != scale.device:
        raise ValueError(
            f"x, data and scale must share a device, got {x.device}, {data.device}, {scale.device}"
        )
    check_shape(full, columnwise=columnwise)
    _check_scale_buffer(scale, full, columnwise)
    if offsets is None:
        if tuple(x.shape) != full:
            raise ValueError(
                f"x has shape {tuple(x.shape)} but the data buffer has shape {full}; pass offsets for a box"
            )
        offsets = (0,) * len(full)
    offsets = tuple(int(o) for o in offsets)
    if len(offsets) != len(full) or x.dim() != len(full):
        raise ValueError(f"offsets {offsets} and x shape {tuple(x.shape)} must both have {len(full)} dims")
    if not box_is_block_aligned(offsets, tuple(x.shape), full, columnwise=columnwise):
        kind = "columnwise" if columnwise else "rowwise"
        raise ValueError(
            f"box at offsets {offsets} with sizes {tuple(x.shape)} of shape {full} is not made of whole "
            f"{kind} MXFP8 blocks of {BLOCK}"
        )
    _quantize_box(x, data.view(torch.uint8), scale.view(torch.uint8), offsets, columnwise)


def _check_scale_buffer(scale: torch.Tensor, full: tuple[int, ...], columnwise: bool) -> None:
    rows, cols = valid_scale_shape(full, columnwise=columnwise)
    if scale.dim() != 2 or scale.shape[0] < rows or scale.shape[1] < cols:
        raise ValueError(
            f"scale buffer of shape {tuple(scale.shape)} is too small for a tensor of shape {full}: "
            f"needs at least {(rows, cols)} (padded TE shape {scale_shape(full, columnwise=columnwise)})"
        )


def _merged_2d(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D view ``[-1, t.shape[-1]]`` without copying, or None if its strides forbid it."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _quantize_box(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offsets: tuple[int, ...], columnwise: bool
) -> None:
    """Write the quantization of box ``x`` (already validated) into uint8 ``data`` / ``scale``."""
    full = tuple(data.shape)
    sizes = tuple(x.shape)
    if math.prod(sizes) == 0:
        return
    m_full, k_full = flat_rows(full), full[-1]
    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    dview = data[box]
    kw = sizes[-1]
    if columnwise:
        inner = math.prod(full[1:-1])
        b0, b1 = offsets[0] * inner // BLOCK, (offsets[0] + sizes[0]) * inner // BLOCK
        sview = scale[b0:b1, offsets[-1] : offsets[-1] + kw]
    else:
        nb = k_full // BLOCK
        rows_view = scale[:m_full, :nb].view(*full[:-1], nb)
        sview = rows_view[box[:-1] + (slice(offsets[-1] // BLOCK, (offsets[-1] + kw) // BLOCK),)]
    d2, s2 = _merged_2d(dview), _merged_2d(sview)
    d_tmp = d2 is None
    s_tmp = s2 is None
    if d_tmp:
        d2 = torch.empty(dview.shape, dtype=torch.uint8, device=data.device).view(-1, kw)
    if s_tmp:
        s2 = torch.empty(sview.shape, dtype=torch.uint8, device=data.device).view(-1, sview.shape[-1])
    quantize_2d(x.reshape(-1, kw), d2, s2, columnwise=columnwise)
    if d_tmp:
        dview.copy_(d2.view(dview.shape))
    if s_tmp:
        sview.copy_(s2.view(sview.shape))
    if sizes == full:
        _zero_scale_padding(scale, full, columnwise)


def _zero_scale_padding(scale: torch.Tensor, full: tuple[int, ...], columnwise: bool) -> None:
    rows, cols = valid_scale_shape(full, columnwise=columnwise)
    if scale.shape[0] > rows:
        scale[rows:].zero_()
    if scale.shape[1] > cols:
        scale[:rows, cols:].zero_()


@torch.no_grad()
def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    columnwise: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Values ``fp32(e4m3) * 2^(e-127)`` cast to ``dtype``, as TE's dequantize; reads only the valid scales.

    ``data`` is uint8 (or float8_e4m3fn) in the tensor's shape; ``scale`` is 2-D uint8 (or float8_e8m0fnu),
    padded or exactly the valid region. The product is exact in fp32 (and in bf16 except underflow).
    NaN stays NaN, but its bits (sign, payload) depend on the device: compare NaNs as NaN.
    """
    if data.dtype not in _DATA_DTYPES:
        raise TypeError(f"data must be uint8 or float8_e4m3fn, got {data.dtype}")
    if scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"scale must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dequantize produces bfloat16, float16 or float32, got {dtype}")
    if data.device != scale.device:
        raise ValueError(f"data and scale must share a device, got {data.device} and {scale.device}")
    shape = tuple(data.shape)
    check_shape(shape, columnwise=columnwise)
    _check_scale_buffer(scale, shape, columnwise)
    rows, cols = valid_scale_shape(shape, columnwise=columnwise)
    s = e8m0_to_float(scale.view(torch.uint8)[:rows, :cols])
    vals = data.view(torch.float8_e4m3fn).reshape(flat_rows(shape), shape[-1]).float()
    if columnwise:
        out = vals.view(rows, BLOCK, cols).mul_(s.unsqueeze(1))
    else:
        out = vals.view(rows, cols, BLOCK).mul_(s.unsqueeze(-1))
    return out.to(dtype).view(shape)
