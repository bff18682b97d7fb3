"""Pure-PyTorch MXFP8 quantization kernels on 2-D views (internal; see ``format.py`` for the API).

Each kernel makes two chunked passes over the rows of ``x``: pass 1 takes every block's amax (as the int32
bits of |x|, which order like the values; NaN elements are then dropped as TE's ``fmaxf`` drops them),
the E8M0 bytes and multipliers are computed for all blocks at once, and pass 2 writes
``e4m3(fp32(x) * multiplier)``. Chunks keep the fp32 workspace cache-resident on CPU; the outputs may be
strided views (regions of larger persistent buffers).
"""

from __future__ import annotations

import functools

import torch

from .e8m0 import E4M3_MAX, e8m0_from_amax_bits, e8m0_multiplier
from .layout import BLOCK

_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_CPU_CHUNK_ELEMS = 1 << 18  # 1 MiB of fp32 workspace: stays in L2
_DEVICE_CHUNK_ELEMS = 1 << 24


@functools.cache
def _cast_saturates(device_type: str) -> bool:
    """Whether this torch's fp32 → float8_e4m3fn cast saturates (±inf, overflow → ±448) on the device.

    torch 2.13 does; older builds produced NaN on overflow, so we clamp first there.
    """
    probe = torch.tensor([1e6, float("inf"), -float("inf")], device=device_type)
    return probe.to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0x7E, 0xFE]


def _chunk_rows(x: torch.Tensor, granule: int) -> int:
    """Rows per chunk: a multiple of ``granule`` sized to the device's chunk budget."""
    budget = _CPU_CHUNK_ELEMS if x.device.type == "cpu" else _DEVICE_CHUNK_ELEMS
    rows = budget // max(1, x.shape[1]) // granule * granule
    return max(granule, rows)


def _abs_bits_into(xc: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Write the int32 bits of ``|fp32(xc)|`` into the fp32 workspace ``w``; return them as an int32 view."""
    wi = w.view(torch.int32)
    if xc.dtype == torch.float32:
        torch.bitwise_and(xc.view(torch.int32), _ABS_MASK, out=wi)
    else:
        w.copy_(xc)
        wi.bitwise_and_(_ABS_MASK)
    return wi


def _drop_nan_from_amax(amax_bits: torch.Tensor, blocks_of) -> None:
    """Recompute, ignoring NaN elements, the amax of blocks whose amax came out NaN (rare path).

    ``blocks_of(index_tuple)`` returns those blocks' elements as ``[n, 32]``.
    """
    bad = amax_bits > _INF_BITS
    if not bool(bad.any()):
        return
    idx = bad.nonzero(as_tuple=True)
    vals = blocks_of(idx).float().abs()
    vals = torch.where(vals.isnan(), torch.zeros((), dtype=vals.dtype, device=vals.device), vals)
    amax_bits[idx] = vals.amax(dim=-1).view(torch.int32)


def _scale_into(xc: torch.Tensor, mult: torch.Tensor, w: torch.Tensor) -> None:
    """``w = fp32(xc) * mult`` (broadcast), one fp32 multiply per element as TE's ``mul_cvt``."""
    if xc.dtype == torch.float32:
        torch.mul(xc, mult, out=w)
    else:
        w.copy_(xc)
        w.mul_(mult)


def _store_e4m3(w: torch.Tensor, data: torch.Tensor) -> None:
    """Saturating round-to-nearest-even cast of fp32 ``w`` into the uint8 ``data`` view (NaN stays NaN)."""
    if not _cast_saturates(w.device.type):
        w.clamp_(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    data.view(torch.float8_e4m3fn).copy_(w)


def quantize_rowwise_2d(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize ``x [m, k]`` with 1x32 blocks into ``data [m, k]`` and ``scale [m, k/32]`` (uint8 views)."""
    m, k = x.shape
    nb = k // BLOCK
    if m == 0 or nb == 0:
        return
    rows = _chunk_rows(x, 1)
    amax = torch.empty(m, nb, dtype=torch.int32, device=x.device)
    ws = torch.empty(min(rows, m) * k, dtype=torch.float32, device=x.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        wi = _abs_bits_into(x[r0:r1], ws[: (r1 - r0) * k].view(r1 - r0, k))
        torch.amax(wi.view(r1 - r0, nb, BLOCK), dim=-1, out=amax[r0:r1])
    _drop_nan_from_amax(amax, lambda idx: x.unflatten(-1, (nb, BLOCK))[idx])
    e = e8m0_from_amax_bits(amax)
    scale.copy_(e)
    mult = e8m0_multiplier(e).unsqueeze(-1)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        w = ws[: (r1 - r0) * k].view(r1 - r0, k)
        _scale_into(x[r0:r1].unflatten(-1, (nb, BLOCK)), mult[r0:r1], w.view(r1 - r0, nb, BLOCK))
        _store_e4m3(w, data[r0:r1])


def quantize_columnwise_2d(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize ``x [m, k]`` (m % 32 == 0) with 32x1 blocks into ``data [m, k]`` and ``scale [m/32, k]``."""
    m, k = x.shape
    mb = m // BLOCK
    if mb == 0 or k == 0:
        return
    rows = _chunk_rows(x, BLOCK)
    amax = torch.empty(mb, k, dtype=torch.int32, device=x.device)
    ws = torch.empty(min(rows, m) * k, dtype=torch.float32, device=x.device)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        wi = _abs_bits_into(x[r0:r1], ws[: (r1 - r0) * k].view(r1 - r0, k))
        torch.amax(wi.view((r1 - r0) // BLOCK, BLOCK, k), dim=1, out=amax[r0 // BLOCK : r1 // BLOCK])
    _drop_nan_from_amax(amax, lambda idx: x.unflatten(0, (mb, BLOCK))[idx[0], :, idx[1]])
    e = e8m0_from_amax_bits(amax)
    scale.copy_(e)
    mult = e8m0_multiplier(e).unsqueeze(1)
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        w = ws[: (r1 - r0) * k].view(r1 - r0, k)
        nblk = (r1 - r0) // BLOCK
        _scale_into(
            x[r0:r1].unflatten(0, (nblk, BLOCK)),
            mult[r0 // BLOCK : r1 // BLOCK],
            w.view(nblk, BLOCK, k),
        )
        _store_e4m3(w, data[r0:r1])
