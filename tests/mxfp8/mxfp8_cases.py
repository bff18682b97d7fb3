"""Test inputs for MXFP8: random data over many binades and blocks built to hit every edge of TE's rule."""

from __future__ import annotations

import math

import torch

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` with the given raw bit patterns."""
    width = 32 if dtype == torch.float32 else 16
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=_INT[dtype]).view(dtype)


def bits_of(v: float, dtype: torch.dtype) -> int:
    """Raw bits of ``v`` rounded to ``dtype``."""
    width = 32 if dtype == torch.float32 else 16
    return torch.tensor([v], dtype=dtype).view(_INT[dtype]).item() & ((1 << width) - 1)


def neighbours(v: float, dtype: torch.dtype) -> list[float]:
    """``v`` (rounded to dtype) and its next-down and next-up values in ``dtype`` (positive ``v``)."""
    b = bits_of(v, dtype)
    return from_bits([b - 1, b, b + 1], dtype).tolist()


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """randn scaled per row by powers of two spread over most of ``dtype``'s range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    lo, hi = (-20, 14) if dtype == torch.float16 else (-120, 120)
    rows = x.reshape(-1, shape[-1])
    exps = torch.randint(lo, hi, (rows.shape[0], 1), generator=g).double()
    return (rows * torch.exp2(exps)).reshape(shape).to(dtype)


def edge_blocks(dtype: torch.dtype, seed: int = 0) -> list[list[float]]:
    """32-element blocks probing TE's rule in ``dtype``: each block is a list of 32 floats."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)

    def filler(scale: float) -> list[float]:
        return (torch.rand(31, generator=g, dtype=torch.float64) * 2 - 1).mul(scale).tolist()

    blocks: list[list[float]] = [[0.0] * 32, [-0.0] * 32]
    # amax exactly 448·2^k and its dtype neighbours, over the whole exponent range of the dtype
    k_lo = -24 - 8 if dtype == torch.float16 else -149 - 8
    k_hi = 8 if dtype == torch.float16 else 119
    for k in range(k_lo, k_hi):
        target = 448.0 * 2.0**k
        if target < info.tiny * 2.0**-10 or target > info.max:
            continue
        for v in neighbours(target, dtype):
            if 0 < v < math.inf:
                blocks.append([v, *filler(v)])
                blocks.append([-v, *filler(v)])
    # tiny blocks around 2^-127 and 448·2^-127 (val near the E8M0 subnormal threshold)
    for base in (2.0**-127, 448.0 * 2.0**-127, 448.0 * 2.0**-126, 224.0 * 2.0**-127):
        if base >= info.tiny * 2.0**-10:
            for v in neighbours(base, dtype):
                blocks.append([v, *filler(v)])
    # subnormal inputs of the dtype
    sub = [info.tiny * i / 8 for i in range(1, 8)]
    blocks.append((sub * 5)[:32])
    blocks.append([info.tiny, *filler(info.tiny)])
    # largest finite values, infinities, NaNs
    blocks.append([info.max, *filler(info.max)])
    blocks.append([-info.max, info.max, *filler(1.0)[:30]])
    blocks.append([math.inf, *filler(3.0)])
    blocks.append([-math.inf, *filler(3.0)])
    blocks.append([math.inf, -math.inf, *filler(1e-3)[:30]])
    blocks.append([math.nan, *filler(5.0)])
    blocks.append([*filler(5.0)[:16], -math.nan, *filler(5.0)[:15]])
    blocks.append([math.nan] * 32)
    blocks.append([math.nan, math.inf, *filler(1.0)[:30]])
    blocks.append([math.nan, 0.0, *[0.0] * 30])
    # E4M3 rounding ties at scale 1 (amax 256 → e = 127, multiplier 1)
    ties = [1.0625, 1.1875, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10, 2.0**-7 * 1.0625, 232.0, 240.0, 248.0]
    blocks.append((ties + [-t for t in ties] + [256.0] + [0.0] * 32)[:32])
    # sub-E4M3 elements next to a large one, and mixed signs
    blocks.append([400.0, 1e-6, -1e-6, 2.0**-9, -(2.0**-9), *filler(1e-2)[:27]])
    return [[float(v) for v in b] for b in blocks]


def edge_tensor(dtype: torch.dtype, blocks_per_row: int = 3, seed: int = 0) -> torch.Tensor:
    """All ``edge_blocks`` laid out rowwise as ``[M, 32*blocks_per_row]``, random blocks filling the rest."""
    blocks = edge_blocks(dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    while len(blocks) % (blocks_per_row * 32):
        blocks.append(torch.randn(32, generator=g, dtype=torch.float64).tolist())
    flat = torch.tensor([v for b in blocks for v in b], dtype=torch.float64)
    return flat.to(dtype).view(-1, 32 * blocks_per_row)


NAN_BITS = {
    torch.float32: [
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFD00BAD
    ],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD0],
    torch.float16: [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7FFF, 0xFFFF, 0x7D55, 0xFE77],
}
"""Quiet and signalling NaNs of both signs with different payloads, as raw bits of each dtype."""


def nan_case(dtype: torch.dtype, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, data, valid_scale)``: four blocks holding ``NAN_BITS`` and their exact MXFP8 bytes (TE's rule).

    NaN is left out of the amax and every NaN element is byte 0x7F. Blocks: NaNs with 256, 1, -1 (amax 256:
    scale 127, data 0x78, 0x38, 0xB8); NaNs only (scale 0x00); NaNs with +inf and -inf (scale 0xFE, data
    ±448 = 0x7E/0xFE, 1.0 underflows to 0); finite values between NaNs (NaN at odd and even positions).
    Rowwise the blocks are the rows of a ``[4, 32]`` tensor; columnwise the first 4 columns of ``[32, 32]``.
    """
    nans = from_bits(NAN_BITS[dtype], dtype)
    n = nans.numel()
    blocks = torch.zeros(4, 32, dtype=dtype)
    data = torch.zeros(4, 32, dtype=torch.uint8)
    blocks[0, :n] = nans
    blocks[0, n : n + 3] = torch.tensor([256.0, 1.0, -1.0])
    data[0, :n] = 0x7F
    data[0, n : n + 3] = torch.tensor([0x78, 0x38, 0xB8])
    blocks[1] = nans.repeat(32 // n)
    data[1] = 0x7F
    blocks[2, :n] = nans
    blocks[2, n : n + 3] = torch.tensor([math.inf, -math.inf, 1.0])
    data[2, :n] = 0x7F
    data[2, n : n + 2] = torch.tensor([0x7E, 0xFE])
    blocks[3, 1 : 2 * n : 2] = nans  # odd positions
    blocks[3, 2 * n] = nans[1]  # an even position
    blocks[3, 0 : 2 * n : 2] = torch.tensor([-256.0, *[1.0] * (n - 1)])
    data[3, 1 : 2 * n : 2] = 0x7F
    data[3, 2 * n] = 0x7F
    data[3, 0 : 2 * n : 2] = torch.tensor([0xF8, *[0x38] * (n - 1)])
    scale = torch.tensor([127, 0x00, 0xFE, 127], dtype=torch.uint8)
    if not columnwise:
        return blocks, data, scale.view(4, 1)
    x = torch.zeros(32, 32, dtype=dtype)
    x[:, :4] = blocks.t()
    full_data = torch.zeros(32, 32, dtype=torch.uint8)
    full_data[:, :4] = data.t()
    full_scale = torch.zeros(1, 32, dtype=torch.uint8)
    full_scale[0, :4] = scale
    return x, full_data, full_scale
