"""The built-in extractor chain: DTensor, then Megatron-style attributes, then plain tensors.

A plain tensor with a ``declare_layout`` declaration is taken at its word first (an explicit
declaration is more specific than the Megatron attributes or groups around it).

``reshard_core.builtin_hooks`` offers it as the ``trylast`` hook implementation, so any plugin's
extractor (e.g. a quantized-param one) is asked first; one function tries the three built-ins in a
fixed order, which pluggy's registration order could not guarantee. Plugins call it directly to ask
what the core alone would say about a tensor.
"""

from __future__ import annotations

from .dtensor import extract_dtensor
from .megatron import extract_megatron
from .plain import LAYOUT_ATTR, extract_plain, is_plain


def reshard_extract_tensor(qualname, tensor, owner, model, side, context):
    """Specs from the first built-in extractor that claims ``tensor``, or None."""
    if getattr(tensor, LAYOUT_ATTR, None) is not None and is_plain(tensor):
        return extract_plain(qualname, tensor, context)
    specs = extract_dtensor(qualname, tensor, context)
    if specs is None:
        specs = extract_megatron(qualname, tensor, owner, model, context)
    if specs is None:
        specs = extract_plain(qualname, tensor, context)
    return specs
