"""reshard-mxfp8: the MXFP8 format (bit-exact with Transformer Engine) for reshard.

Public API (pure PyTorch; importing this package imports torch only):

- ``quantize(x, *, columnwise=False) -> (data, scale)`` and ``dequantize(data, scale, ...)``;
- ``quantize_into(x, data, scale, *, columnwise=False, offsets=None)`` into persistent buffers, also for a
  block-aligned box of the weight; ``empty_quantized(shape, ...)`` allocates such buffers;
- ``swizzle_128x4`` / ``unswizzle_128x4`` for the cuBLAS/FlashInfer 1-D scale layout;
- layout helpers ``scale_shape``, ``valid_scale_shape``, ``box_is_block_aligned`` and the E8M0 rules.
"""

from .e8m0 import E4M3_MAX, e8m0_multiplier, e8m0_to_float, float_to_e8m0
from .format import dequantize, empty_quantized, quantize, quantize_into
from .layout import BLOCK, box_is_block_aligned, scale_shape, valid_scale_shape
from .swizzle import swizzle_128x4, unswizzle_128x4

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "box_is_block_aligned",
    "dequantize",
    "e8m0_multiplier",
    "e8m0_to_float",
    "empty_quantized",
    "float_to_e8m0",
    "quantize",
    "quantize_into",
    "scale_shape",
    "swizzle_128x4",
    "unswizzle_128x4",
    "valid_scale_shape",
]
