"""reshard-mxfp8: the MXFP8 format (bit-exact with Transformer Engine) for reshard.

Public API (pure PyTorch; importing this package imports torch only):

- ``quantize(x, *, columnwise=False) -> (data, scale)`` and ``dequantize(data, scale, ...)``;
- ``quantize_into(x, data, scale, *, columnwise=False, offsets=None)`` into persistent buffers, also for a
  block-aligned box of the weight; ``empty_quantized(shape, ...)`` allocates such buffers;
- ``swizzle_128x4`` / ``unswizzle_128x4`` for the cuBLAS/FlashInfer 1-D scale layout;
- layout helpers ``scale_shape``, ``valid_scale_shape``, ``box_is_block_aligned`` and the E8M0 rules;
- ``make_mxfp8`` / ``destinations_of`` / ``MXFP8Destination`` (persistent destination buffers) and
  ``MXFP8ReshardTransform`` (these import reshard_core, lazily on first access);
- ``configure_te_extraction`` (options of the TE FSDP2 param extractor, ``te_extract``).
"""

from .e8m0 import E4M3_MAX, e8m0_multiplier, e8m0_to_float, float_to_e8m0
from .format import dequantize, empty_quantized, quantize, quantize_into
from .layout import BLOCK, box_is_block_aligned, scale_shape, valid_scale_shape
from .swizzle import swizzle_128x4, unswizzle_128x4

_LAZY = {
    "make_mxfp8": "destinations",
    "destinations_of": "destinations",
    "MXFP8Destination": "destinations",
    "MXFP8ReshardTransform": "transform",
    "quantized_on_wire": "transform",
    "configure_te_extraction": "te_extract",
}


def __getattr__(name: str):
    """Import the reshard_core-dependent parts on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MXFP8Destination",
    "MXFP8ReshardTransform",
    "configure_te_extraction",
    "destinations_of",
    "make_mxfp8",
    "quantized_on_wire",
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
