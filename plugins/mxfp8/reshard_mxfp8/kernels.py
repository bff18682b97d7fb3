"""Pure-PyTorch MXFP8 quantization kernels on 2-D views (internal; see ``format.py`` for the API).

The rows of ``x`` are processed in groups of a few million elements, each in cache-sized chunks. Per
group: pass 1 takes every block's amax as the int32 bits of |x| (non-negative floats order like their
bits; blocks holding NaN are then redone without it, as TE's ``fmaxf`` drops NaN); the E8M0 bytes and
multipliers of the group are computed in place with integer ops; pass 2 writes ``e4m3(fp32(x) * mult)``.
NaN rule (TE's): every NaN element becomes byte 0x7F, whatever its sign or payload, on every device.
All workspaces are allocated once per call and reused, since fresh multi-MB temporaries cost page faults.
Outputs may be strided views (regions of larger persistent buffers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .e8m0 import E4M3_MAX, MAX_NORM_RCP_BITS
from .layout import BLOCK

_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_CPU_CHUNK_ELEMS = 1 << 20  # 4 MiB fp32 workspace: cache-resident; fewer, larger ops
_CPU_GROUP_ELEMS = 1 << 22  # scale math runs on 128 Ki blocks at a time
_DEVICE_CHUNK_ELEMS = 1 << 24


@functools.cache
def _cast_saturates(device_type: str) -> bool:
    """Whether this torch's fp32 → float8_e4m3fn cast saturates (±inf, overflow → ±448) on the device.

    torch 2.13 does; older builds produced NaN on overflow, so we clamp first there.
    """
    probe = torch.tensor([1e6, float("inf"), -float("inf")], device=device_type)
    return probe.to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0x7E, 0xFE]


def e8m0_and_multiplier_(amax_bits: torch.Tensor, tmp: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """Turn ``amax_bits`` (int32 bits of non-NaN amax ≥ 0) into E8M0 bytes in place; fill ``mult``.

    Same results as ``e8m0.e8m0_from_amax_bits`` and ``e8m0.e8m0_multiplier`` (tested against them), with
    only in-place arithmetic on preallocated buffers: ``tmp`` is int32 and ``mult`` fp32, both shaped like
    ``amax_bits``. Returns ``amax_bits``, now holding the bytes as int32.
    """
    rcp = torch.tensor(MAX_NORM_RCP_BITS, dtype=torch.int32, device=amax_bits.device).view(torch.float32)
    vb = amax_bits.view(torch.float32).mul_(rcp).view(torch.int32)  # val = amax * fl(1/448), fp32 RN
    # tmp = 1 where val > 2^-127 (bits > 0x400000), else 0: such tiny vals map to byte 0
    torch.clamp(vb, max=0x400001, out=tmp).add_(0x3FFFFF).bitwise_right_shift_(23)
    # e << 23: ceil to a power of two by carrying a non-zero mantissa into the exponent, saturating at 2^127
    vb.clamp_(max=0x7F000000).add_(0x7FFFFF).bitwise_and_(_INF_BITS).mul_(tmp)
    # exp2f_rcp(e) = 2^(127-e): bits (254-e) << 23, and 2^-127 (0x400000) for e == 254
    mult_bits = mult.view(torch.int32)
    torch.sub(torch.tensor(0x7F000000, dtype=torch.int32, device=vb.device), vb, out=mult_bits)
    mult_bits.clamp_(min=0x00400000)
    return vb.bitwise_right_shift_(23)


@dataclass(frozen=True)
class _Direction:
    """How blocks sit in a ``[rows, k]`` chunk: 1x32 along k (rowwise) or 32x1 along rows (columnwise)."""

    columnwise: bool

    @property
    def granule(self) -> int:
        """Rows that share one row of scales."""
        return BLOCK if self.columnwise else 1

    def blocks(self, t: torch.Tensor) -> torch.Tensor:
        """``t [rows, k]`` as ``[rows/32, 32, k]`` or ``[rows, k/32, 32]``."""
        return t.unflatten(0, (-1, BLOCK)) if self.columnwise else t.unflatten(-1, (-1, BLOCK))

    @property
    def reduce_dim(self) -> int:
        return 1 if self.columnwise else 2

    def block_elements(self, x: torch.Tensor, idx: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The elements ``[n, 32]`` of the blocks at scale positions ``idx`` of ``x [rows, k]``."""
        b = self.blocks(x)
        return b[idx[0], :, idx[1]] if self.columnwise else b[idx]


def _chunk_rows(x: torch.Tensor, granule: int, elems: int) -> int:
    rows = elems // max(1, x.shape[1]) // granule * granule
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


def _bf16_pairs_ok(x: torch.Tensor) -> bool:
    """Whether ``x`` (bf16) can be viewed as int32 pairs of adjacent elements along the last dim."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and x.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in x.stride()[:-1])
    )


def _rowwise_amax_bf16_pairs(xc: torch.Tensor, ws: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> None:
    """Rowwise block amax bits of bf16 ``xc [r, k]`` into int32 ``out [r, k/32]``, without an fp32 copy.

    Each int32 of ``xc.view(int32)`` holds two neighbours; masked with 0x7FFF7FFF, the max of the int32s
    of a block has the larger |odd| element in its top half, and after a left shift by 16 the max is the
    larger |even| element, already as fp32 bits (bf16 bits << 16 are the fp32 bits of the same value).
    ``ws`` is an int32 workspace of ``r * k/2`` elements, ``lo`` an int32 ``[r, k/32]`` workspace.
    """
    r, k = xc.shape
    p = ws[: r * k // 2].view(r, k // 2)
    torch.bitwise_and(xc.view(torch.int32), 0x7FFF7FFF, out=p)
    pairs = p.view(r, k // BLOCK, BLOCK // 2)
    torch.amax(pairs, dim=-1, out=out)
    p.bitwise_left_shift_(16)
    torch.amax(pairs, dim=-1, out=lo)
    out.bitwise_and_(-65536)  # 0xFFFF0000: keep the odd element's bits
    torch.maximum(out, lo, out=out)


def _drop_nan_from_amax(amax_bits: torch.Tensor, x: torch.Tensor, d: _Direction) -> bool:
    """Recompute, ignoring NaN elements, the amax of blocks whose amax came out NaN (rare path).

    Returns whether any block of ``x`` holds a NaN.
    """
    if amax_bits.numel() == 0 or int(amax_bits.max()) <= _INF_BITS:
        return False
    idx = (amax_bits > _INF_BITS).nonzero(as_tuple=True)
    vals = d.block_elements(x, idx).float().abs()
    vals = torch.where(vals.isnan(), torch.zeros((), dtype=vals.dtype, device=vals.device), vals)
    amax_bits[idx] = vals.amax(dim=-1).view(torch.int32)
    return True


def _store_e4m3(w: torch.Tensor, data: torch.Tensor) -> None:
    """Saturating round-to-nearest-even cast of fp32 ``w`` into the uint8 ``data`` view (NaN → 0x7F/0xFF)."""
    if not _cast_saturates(w.device.type):
        w.clamp_(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
    data.view(torch.float8_e4m3fn).copy_(w)


def _canonicalize_nan_(data: torch.Tensor) -> None:
    """Turn the negative-NaN byte 0xFF of uint8 ``data`` into 0x7F, TE's byte for every NaN.

    TE multiplies in fp32 before its e4m3 cvt, and CUDA arithmetic returns the canonical NaN 0x7FFFFFFF
    (as does ``__nv_cvt_float_to_fp8``), so the sign is lost there, while the CPU multiply and cast keep it.
    0xFF is never the byte of a number, so the fix-up touches NaNs only.
    """
    data.masked_fill_(data == 0xFF, 0x7F)


def quantize_2d(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, *, columnwise: bool) -> None:
    """Quantize ``x [m, k]`` into uint8 views ``data [m, k]`` and ``scale`` (``[m, k/32]`` or ``[m/32, k]``).

    Columnwise needs ``m % 32 == 0``; rowwise needs ``k % 32 == 0``. Shapes are the caller's to check.
    """
    d = _Direction(columnwise)
    m, k = x.shape
    if m == 0 or k == 0:
        return
    on_cpu = x.device.type == "cpu"
    chunk = _chunk_rows(x, d.granule, _CPU_CHUNK_ELEMS if on_cpu else _DEVICE_CHUNK_ELEMS)
    group = _chunk_rows(x, chunk, _CPU_GROUP_ELEMS) if on_cpu else chunk
    group = min(group, -(-m // chunk) * chunk)
    ws = torch.empty(min(chunk, m) * k, dtype=torch.float32, device=x.device)
    srows, scols = scale.shape
    g_scale_rows = min(group // d.granule, srows)
    amax_ws = torch.empty(g_scale_rows * scols, dtype=torch.int32, device=x.device)
    tmp_ws = torch.empty_like(amax_ws)
    mult_ws = torch.empty(amax_ws.shape, dtype=torch.float32, device=x.device)
    pairs = not columnwise and _bf16_pairs_ok(x)
    lo_ws = torch.empty(min(chunk, m) * scols if pairs else 0, dtype=torch.int32, device=x.device)
    gr = d.granule
    for g0 in range(0, m, group):
        g1 = min(m, g0 + group)
        n = (g1 - g0) // gr * scols
        amax = amax_ws[:n].view(-1, scols)
        for r0 in range(g0, g1, chunk):
            r1 = min(g1, r0 + chunk)
            amax_c = amax[(r0 - g0) // gr : (r1 - g0) // gr]
            if pairs:
                lo = lo_ws[: amax_c.numel()].view_as(amax_c)
                _rowwise_amax_bf16_pairs(x[r0:r1], ws.view(torch.int32), lo, amax_c)
            else:
                wi = _abs_bits_into(x[r0:r1], ws[: (r1 - r0) * k].view(r1 - r0, k))
                torch.amax(d.blocks(wi), dim=d.reduce_dim, out=amax_c)
        has_nan = _drop_nan_from_amax(amax, x[g0:g1], d)
        mult = mult_ws[:n].view(-1, scols)
        e = e8m0_and_multiplier_(amax, tmp_ws[:n].view(-1, scols), mult)
        scale[g0 // gr : g1 // gr].copy_(e)
        mult = mult.unsqueeze(d.reduce_dim)
        for r0 in range(g0, g1, chunk):
            r1 = min(g1, r0 + chunk)
            w = ws[: (r1 - r0) * k].view(r1 - r0, k)
            xb, wb = d.blocks(x[r0:r1]), d.blocks(w)
            mc = mult[(r0 - g0) // gr : (r1 - g0) // gr]
            if x.dtype == torch.float32:
                torch.mul(xb, mc, out=wb)
            else:
                w.copy_(x[r0:r1])
                wb.mul_(mc)  # fp32(x) * mult: one fp32 multiply per element, as TE's mul_cvt
            _store_e4m3(w, data[r0:r1])
        if has_nan:
            _canonicalize_nan_(data[g0:g1])
