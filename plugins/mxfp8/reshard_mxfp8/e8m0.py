"""E8M0 shared-scale rules of MXFP8, exactly as Transformer Engine computes them.

An E8M0 byte ``e`` stands for 2^(e-127) (0x00 = 2^-127, 0xFE = 2^127, 0xFF = NaN). TE picks a block's byte
from ``val = fp32(amax) * fl(1/448)`` rounded *up* to a power of two ("RCEIL", PTX
``cvt.rp.satfinite.ue8m0x2.f32``), and scales the elements by the reciprocal ``exp2f_rcp(e)``.
Everything here is integer bit manipulation on ``.view(torch.int32)``: ``log2`` loses the rounding of
large exponents and ``.to(torch.float8_e8m0fnu)`` rounds to nearest, so neither is used.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
"""Largest finite FP8 E4M3 magnitude (byte 0x7E)."""

MAX_NORM_RCP_BITS = 0x3B124925
"""Bits of ``(float)(1.0/448)`` = 0x1.24924ap-9, TE's ``Quantized_Limits::max_norm_rcp``."""

_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


def _check_int32(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{what} must be an int32 tensor of float bits, got {t.dtype}")


def e8m0_from_val_bits(val_bits: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (as int32 0..255) of the fp32 values whose bits are ``val_bits`` (sign ignored).

    Same rule as TE's ``float_to_e8m0``: NaN → 0xFF, inf → 0xFE, 0 → 0x00; otherwise the exponent
    rounded up to the next power of two, saturating at 0xFE, with every subnormal value ≤ 2^-127
    (bits ≤ 0x400000) mapping to 0x00. Does not modify ``val_bits``.
    """
    _check_int32(val_bits, "val_bits")
    a = val_bits & _ABS_MASK
    # Adding 0x7FFFFF carries into the exponent iff the mantissa is non-zero: a ceil to a power of two.
    # Clamping at 2^127 first gives the saturation (and inf → 0xFE) and keeps the add from overflowing.
    e = (a.clamp(max=0x7F000000) + 0x7FFFFF).bitwise_right_shift_(23)
    e.masked_fill_(a <= 0x400000, 0)
    e.masked_fill_(a > _INF_BITS, 0xFF)
    return e


def float_to_e8m0(val: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) of fp32 ``val`` (sign ignored), by TE's ``float_to_e8m0`` rule."""
    if val.dtype != torch.float32:
        raise TypeError(f"float_to_e8m0 takes float32 values, got {val.dtype}")
    return e8m0_from_val_bits(val.contiguous().view(torch.int32)).to(torch.uint8)


def e8m0_from_amax_bits(amax_bits: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (int32 0..255) of blocks whose fp32 amax has bits ``amax_bits`` (≥ 0, not NaN).

    ``val = amax * fl(1/448)`` is one fp32 multiply rounded to nearest even, as in TE.
    """
    _check_int32(amax_bits, "amax_bits")
    rcp = torch.tensor(MAX_NORM_RCP_BITS, dtype=torch.int32, device=amax_bits.device).view(torch.float32)
    val = amax_bits.view(torch.float32) * rcp
    return e8m0_from_val_bits(val.view(torch.int32))


def e8m0_multiplier(e: torch.Tensor) -> torch.Tensor:
    """TE's ``exp2f_rcp(e)`` as fp32: 2^(127-e), with e==254 → 2^-127 (subnormal), e==255 → NaN.

    ``e`` holds E8M0 bytes as any integer dtype (uint8 or int32).
    """
    if e.is_floating_point() or e.dtype == torch.bool:
        raise TypeError(f"e8m0_multiplier takes integer E8M0 bytes, got {e.dtype}")
    ei = e.to(torch.int32)
    bits = (254 - ei).bitwise_left_shift_(23)
    bits.masked_fill_(ei == 254, 0x00400000)
    bits.masked_fill_(ei == 255, 0x7FC00000)
    return bits.view(torch.float32)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Value 2^(e-127) of E8M0 bytes as fp32 (0x00 → 2^-127, 0xFF → NaN); TE's ``exp2f``."""
    if e.dtype == torch.float8_e8m0fnu:
        return e.float()
    if e.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 (or float8_e8m0fnu), got {e.dtype}")
    return e.view(torch.float8_e8m0fnu).float()
