"""Shapes and alignment rules of TE's MXFP8 layout (rowwise 1x32 blocks, columnwise 32x1 blocks).

A tensor of shape ``(..., K)`` is treated as an ``M x K`` matrix with ``M = prod(shape[:-1])``.
Rowwise: blocks are 32 consecutive elements of a row; scale ``[roundup(M,128), roundup(K/32,4)]``.
Columnwise: blocks are 32 consecutive rows of one column; scale ``[roundup(M/32,4), roundup(K,128)]``.
Data has the tensor's own shape in both cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

BLOCK = 32
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def roundup(n: int, m: int) -> int:
    """Smallest multiple of ``m`` that is ≥ ``n``."""
    return -(-n // m) * m


def flat_rows(shape: Sequence[int]) -> int:
    """``M = prod(shape[:-1])``, the row count of the matrix view of ``shape``."""
    return math.prod(shape[:-1])


def scale_shape(shape: Sequence[int], *, columnwise: bool = False) -> tuple[int, int]:
    """Padded uint8 scale shape TE allocates for a tensor of ``shape``."""
    check_shape(shape, columnwise=columnwise)
    m, k = flat_rows(shape), shape[-1]
    if columnwise:
        return roundup(m // BLOCK, 4), roundup(k, 128)
    return roundup(m, 128), roundup(k // BLOCK, 4)


def valid_scale_shape(shape: Sequence[int], *, columnwise: bool = False) -> tuple[int, int]:
    """The meaningful (unpadded) region of the scale: ``[M, K/32]`` rowwise, ``[M/32, K]`` columnwise."""
    check_shape(shape, columnwise=columnwise)
    m, k = flat_rows(shape), shape[-1]
    return (m // BLOCK, k) if columnwise else (m, k // BLOCK)


def check_shape(shape: Sequence[int], *, columnwise: bool = False) -> None:
    """Raise ValueError unless ``shape`` is MXFP8-quantizable in the requested direction."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"MXFP8 needs a tensor of at least 2 dims, got shape {shape}")
    if shape[-1] % BLOCK:
        raise ValueError(f"MXFP8 needs the last dim divisible by {BLOCK}, got shape {shape}")
    if columnwise and flat_rows(shape) % BLOCK:
        raise ValueError(
            f"columnwise MXFP8 needs prod(shape[:-1]) divisible by {BLOCK}, got shape {shape} "
            f"(M = {flat_rows(shape)})"
        )


def check_dtype(x: torch.Tensor) -> None:
    """Raise TypeError unless ``x`` is a bf16/fp16/fp32 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"MXFP8 quantization takes bfloat16, float16 or float32 input, got {x.dtype}")


def check_input(x: torch.Tensor, *, columnwise: bool = False) -> None:
    """Raise TypeError/ValueError unless ``x`` can be quantized whole (dtype and shape)."""
    check_dtype(x)
    check_shape(x.shape, columnwise=columnwise)


def box_is_block_aligned(
    offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int], *, columnwise: bool = False
) -> bool:
    """Whether the box ``(offsets, sizes)`` of a tensor of ``shape`` is made of whole MXFP8 blocks.

    Such a box can be quantized on its own into the matching region of the full tensor's buffers
    (see ``quantize_into``). Rowwise: the last-dim range starts and ends on a multiple of 32.
    Columnwise: the box spans all of dims ``1..ndim-2`` and its flattened row range starts and ends on
    a multiple of 32. Empty boxes are aligned.
    """
    offsets, sizes, shape = tuple(offsets), tuple(sizes), tuple(shape)
    if not (len(offsets) == len(sizes) == len(shape)):
        raise ValueError(f"box rank mismatch: offsets {offsets}, sizes {sizes}, shape {shape}")
    if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
        raise ValueError(f"box offsets {offsets} sizes {sizes} lie outside shape {shape}")
    if math.prod(sizes) == 0:
        return True
    if not columnwise:
        return offsets[-1] % BLOCK == 0 and sizes[-1] % BLOCK == 0
    if any(o != 0 or s != n for o, s, n in zip(offsets[1:-1], sizes[1:-1], shape[1:-1], strict=True)):
        return False
    inner = math.prod(shape[1:-1])
    return (offsets[0] * inner) % BLOCK == 0 and (sizes[0] * inner) % BLOCK == 0
