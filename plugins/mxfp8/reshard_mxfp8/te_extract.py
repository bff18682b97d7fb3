"""TE quantized params under FSDP2 (placeholder until implemented): claims nothing yet."""

from __future__ import annotations


def extract_quantized(qualname, tensor, side, context):
    """Specs for a DTensor whose local tensor is a TE ``MXFP8Tensor``/``Float8Tensor``, else None."""
    return None
