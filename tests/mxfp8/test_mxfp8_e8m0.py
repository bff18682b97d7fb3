"""E8M0 scale-byte rules and multipliers against the scalar oracle, over every exponent and mantissa edge."""

from __future__ import annotations

import math
import random

import mxfp8_oracle as oracle
import torch
from reshard_mxfp8 import e8m0_multiplier, e8m0_to_float, float_to_e8m0
from reshard_mxfp8.e8m0 import e8m0_from_amax_bits
from reshard_mxfp8.kernels import e8m0_and_multiplier_

_MANTISSAS = [0, 1, 2, 0x1FFFFF, 0x3FFFFF, 0x400000, 0x400001, 0x600000, 0x7FFFFE, 0x7FFFFF]


def _patterns(with_nan: bool) -> list[int]:
    """Non-negative fp32 bit patterns: every exponent × edge mantissas, plus random ones."""
    rng = random.Random(0)
    out = [(e << 23) | m for e in range(255) for m in _MANTISSAS]
    out += [rng.randrange(0, 0x7F800000) for _ in range(20000)]
    out.append(0x7F800000)  # inf
    if with_nan:
        out += [0x7F800001, 0x7FC00000, 0x7FFFFFFF]
    return out


def _bits_tensor(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32)


def test_float_to_e8m0_matches_te_rule() -> None:
    bits = _patterns(with_nan=True)
    vals = [oracle.bits_to_f32(b) for b in bits]
    expected = torch.tensor([oracle.float_to_e8m0(v) for v in vals], dtype=torch.uint8)
    got = float_to_e8m0(_bits_tensor(bits).view(torch.float32))
    assert torch.equal(got, expected)
    # the sign is ignored (amax is never negative)
    assert torch.equal(float_to_e8m0(-_bits_tensor(bits).view(torch.float32)), expected)


def test_e8m0_from_amax_matches_oracle() -> None:
    bits = _patterns(with_nan=False)
    expected = [oracle.float_to_e8m0(oracle.f32(oracle.bits_to_f32(b) * oracle.RCP_448)) for b in bits]
    got = e8m0_from_amax_bits(_bits_tensor(bits))
    assert got.tolist() == expected


def test_in_place_kernel_scale_math_equals_reference_functions() -> None:
    bits = _bits_tensor(_patterns(with_nan=False))
    e_ref = e8m0_from_amax_bits(bits)
    mult_ref = e8m0_multiplier(e_ref)
    amax = bits.clone()
    mult = torch.empty(amax.shape, dtype=torch.float32)
    e = e8m0_and_multiplier_(amax, torch.empty_like(amax), mult)
    assert e.data_ptr() == amax.data_ptr()
    assert torch.equal(e, e_ref)
    assert torch.equal(mult.view(torch.int32), mult_ref.view(torch.int32))


def test_multiplier_is_exp2f_rcp() -> None:
    e = torch.arange(256, dtype=torch.int32)
    got = e8m0_multiplier(e).tolist()
    for byte, m in enumerate(got):
        if byte == 255:
            assert math.isnan(m)
        else:
            assert m == math.ldexp(1.0, 127 - byte), byte
    assert e8m0_multiplier(torch.tensor([254], dtype=torch.uint8)).view(torch.int32).item() == 0x00400000
    assert e8m0_multiplier(torch.tensor([0], dtype=torch.uint8)).item() == 2.0**127


def test_e8m0_to_float_all_bytes() -> None:
    got = e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).tolist()
    for byte, v in enumerate(got):
        ref = oracle.e8m0_value(byte)
        assert (math.isnan(v) and math.isnan(ref)) or v == ref, byte
