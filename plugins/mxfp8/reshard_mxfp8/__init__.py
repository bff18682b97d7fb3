"""reshard-mxfp8: the MXFP8 format (bit-exact with Transformer Engine) for reshard.

Public API (pure PyTorch; every name is imported on first use, so importing the package, and its
hook module ``plugin`` that ``reshard plugins list`` loads, imports neither torch nor reshard_core's
heavy parts):

- ``quantize(x, *, columnwise=False) -> (data, scale)`` and ``dequantize(data, scale, ...)``;
- ``quantize_into(x, data, scale, *, columnwise=False, offsets=None)`` into persistent buffers, also for a
  block-aligned box of the weight; ``empty_quantized(shape, ...)`` allocates such buffers;
- ``swizzle_128x4`` / ``unswizzle_128x4`` for the cuBLAS/FlashInfer 1-D scale layout;
- layout helpers ``scale_shape``, ``valid_scale_shape``, ``box_is_block_aligned`` and the E8M0 rules;
- ``make_mxfp8`` / ``destinations_of`` / ``MXFP8Destination`` (persistent destination buffers) and
  ``MXFP8ReshardTransform`` (these import reshard_core, lazily on first access);
- ``configure_te_extraction`` (options of the TE FSDP2 param extractor, ``te_extract``).
"""

_LAZY = {
    "E4M3_MAX": "e8m0",
    "e8m0_multiplier": "e8m0",
    "e8m0_to_float": "e8m0",
    "float_to_e8m0": "e8m0",
    "dequantize": "format",
    "empty_quantized": "format",
    "quantize": "format",
    "quantize_into": "format",
    "BLOCK": "layout",
    "box_is_block_aligned": "layout",
    "scale_shape": "layout",
    "valid_scale_shape": "layout",
    "swizzle_128x4": "swizzle",
    "unswizzle_128x4": "swizzle",
    "make_mxfp8": "destinations",
    "destinations_of": "destinations",
    "MXFP8Destination": "destinations",
    "MXFP8ReshardTransform": "transform",
    "quantized_on_wire": "transform",
    "configure_te_extraction": "te_extract",
}


def __getattr__(name: str):
    """Import the module defining ``name`` on first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
