"""Independent scalar reference of TE's MXFP8 rule (mxfp8.md A.2), one Python float at a time.

Nothing here uses ``reshard_mxfp8``: element values come from the raw bits via ``struct``, fp32 rounding is
``struct.pack('f', exact_double)``, the E8M0 byte follows TE's ``float_to_e8m0`` text literally, and E4M3
rounding searches the table of all 127 finite non-negative codes (nearest, ties to the even code). Slow:
keep the tensors small.
"""

from __future__ import annotations

import bisect
import math
import struct

import torch

RCP_448 = struct.unpack("<f", struct.pack("<f", 1.0 / 448))[0]  # TE: (float)(1.0/448)


def f32(v: float) -> float:
    """Round a double to the nearest fp32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_to_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def element_values(x: torch.Tensor) -> list[float]:
    """The exact values (as Python floats) of a bf16/fp16/fp32 tensor, row-major, from its raw bits."""
    flat = x.contiguous().reshape(-1)
    if x.dtype == torch.float32:
        return [bits_to_f32(b) for b in flat.view(torch.int32).tolist()]
    if x.dtype == torch.bfloat16:
        return [bits_to_f32((b & 0xFFFF) << 16) for b in flat.view(torch.int16).tolist()]
    if x.dtype == torch.float16:
        half_bits = flat.view(torch.int16).tolist()
        return [struct.unpack("<e", struct.pack("<H", b & 0xFFFF))[0] for b in half_bits]
    raise TypeError(x.dtype)


def float_to_e8m0(val: float) -> int:
    """TE's software ``float_to_e8m0`` (``ptx.cuh``), transcribed."""
    if math.isnan(val):
        return 0xFF
    if math.isinf(val):
        return 0xFE
    if val == 0.0:
        return 0x00
    u = f32_bits(val)
    exponent = u >> 23
    mantissa = u & 0x7FFFFF
    if mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def e8m0_value(e: int) -> float:
    """2^(e-127); NaN for 0xFF."""
    return math.nan if e == 0xFF else math.ldexp(1.0, e - 127)


def _e4m3_value(code: int) -> float:
    exp, man = code >> 3, code & 7
    return math.ldexp(man, -9) if exp == 0 else math.ldexp(8 + man, exp - 10)


E4M3_CODES = list(range(0x7F))  # 0x7F is NaN
E4M3_VALUES = [_e4m3_value(c) for c in E4M3_CODES]


def e4m3_value(byte: int) -> float:
    """Value of an E4M3 byte (0x7F/0xFF → NaN)."""
    if byte & 0x7F == 0x7F:
        return math.nan
    v = E4M3_VALUES[byte & 0x7F]
    return -v if byte & 0x80 else v


def to_e4m3(y: float) -> int:
    """Saturating round-to-nearest-even E4M3 byte of the fp32 value ``y``; any NaN → 0x7F.

    0x7F for every NaN is what TE gives: CUDA's fp32 multiply before the cvt returns the canonical
    NaN 0x7FFFFFFF, and ``__nv_cvt_float_to_fp8`` canonicalizes NaN input too.
    """
    if math.isnan(y):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a >= E4M3_VALUES[-1]:
        return sign | 0x7E
    i = bisect.bisect_left(E4M3_VALUES, a)
    if E4M3_VALUES[i] == a:
        return sign | i
    lo, hi = i - 1, i
    d_lo, d_hi = a - E4M3_VALUES[lo], E4M3_VALUES[hi] - a
    code = lo if d_lo < d_hi else hi if d_hi < d_lo else (lo if lo % 2 == 0 else hi)
    return sign | code


def quantize_block(vals: list[float]) -> tuple[list[int], int]:
    """E4M3 bytes and E8M0 byte of one 32-element block, by TE's rule."""
    amax = 0.0
    for v in vals:
        if not math.isnan(v):  # fmaxf / __hmax drop NaN
            amax = max(amax, abs(v))
    e = float_to_e8m0(f32(amax * RCP_448))
    mult = math.nan if e == 0xFF else math.ldexp(1.0, 127 - e)  # exp2f_rcp: e==254 is 2^-127
    out = []
    for v in vals:
        out.append(to_e4m3(f32(v * mult)))
    return out, e


def quantize(x: torch.Tensor, columnwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(data [M,K], valid scale)`` of ``x`` viewed as ``M x K``: ``[M,K/32]`` or ``[M/32,K]``."""
    k = x.shape[-1]
    m = x.numel() // k
    vals = element_values(x)
    data = [0] * (m * k)
    if columnwise:
        scale = [[0] * k for _ in range(m // 32)]
        for b in range(m // 32):
            for c in range(k):
                idx = [(b * 32 + i) * k + c for i in range(32)]
                q, e = quantize_block([vals[i] for i in idx])
                scale[b][c] = e
                for i, byte in zip(idx, q, strict=True):
                    data[i] = byte
    else:
        scale = [[0] * (k // 32) for _ in range(m)]
        for r in range(m):
            for b in range(k // 32):
                start = r * k + b * 32
                q, e = quantize_block(vals[start : start + 32])
                scale[r][b] = e
                data[start : start + 32] = q
    data_t = torch.tensor(data, dtype=torch.uint8).view(m, k)
    rows = len(scale)
    scale_t = torch.tensor(scale, dtype=torch.uint8).view(rows, -1) if rows else torch.zeros(0, 0)
    return data_t, scale_t


def dequantize_values(data: torch.Tensor, scale: torch.Tensor, columnwise: bool = False) -> list[float]:
    """Exact values ``e4m3 * 2^(e-127)`` (row-major) of ``data [M,K]`` with valid ``scale``."""
    m, k = data.shape
    d = data.tolist()
    s = scale.tolist()
    out = []
    for r in range(m):
        for c in range(k):
            e = s[r // 32][c] if columnwise else s[r][c // 32]
            out.append(e4m3_value(d[r][c]) * e8m0_value(e))
    return out
