"""The "128x4" swizzled 1-D scale layout shared by cuBLAS, TE (``optimize_for_gemm``) and FlashInfer.

Element ``(r, c)`` of a padded compact scale ``S[R, C]`` (R % 128 == 0, C % 4 == 0) lands at offset
``((r//128)*(C//4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``: 128x4 tiles stored contiguously,
tiles row-major, ``[32][4 row groups][4 cols]`` inside a tile. For TE columnwise scales pass ``S = scale.T``.
"""

from __future__ import annotations

import torch

from .layout import roundup


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """1-D swizzled copy of the 2-D ``scale [rows, cols]``, zero-padded to 128-row / 4-column multiples.

    Any element dtype is accepted (normally uint8 E8M0 bytes); the result has the same dtype and
    ``roundup(rows,128) * roundup(cols,4)`` elements.
    """
    if scale.dim() != 2:
        raise ValueError(f"swizzle_128x4 takes a 2-D scale, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    r, c = roundup(rows, 128), roundup(cols, 4)
    if (r, c) != (rows, cols):
        padded = torch.zeros((r, c), dtype=scale.dtype, device=scale.device)
        padded[:rows, :cols] = scale
        scale = padded
    return scale.reshape(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_128x4``: the ``[rows, cols]`` compact scale held in the 1-D swizzled ``flat``.

    ``flat`` must have exactly ``roundup(rows,128) * roundup(cols,4)`` elements; the result is contiguous.
    """
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be non-negative, got {rows}, {cols}")
    r, c = roundup(rows, 128), roundup(cols, 4)
    if flat.dim() != 1 or flat.numel() != r * c:
        raise ValueError(
            f"swizzled scale for [{rows}, {cols}] must be 1-D with {r}*{c} = {r * c} elements, "
            f"got shape {tuple(flat.shape)}"
        )
    full = flat.reshape(r // 128, c // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(r, c)
    return full[:rows, :cols].contiguous()
