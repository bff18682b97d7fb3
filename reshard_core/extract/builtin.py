"""The built-in extractor hook: DTensor, then Megatron-style attributes, then plain tensors.

A plain tensor with a ``declare_layout`` declaration is taken at its word first (an explicit
declaration is more specific than the Megatron attributes or groups around it).

Registered by the plugin manager as a built-in hook module. It is ``trylast`` so any plugin's
extractor (e.g. a quantized-param one) is asked first; one implementation tries the three
built-ins in a fixed order, which pluggy's registration order could not guarantee.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from .dtensor import extract_dtensor
from .megatron import extract_megatron
from .plain import LAYOUT_ATTR, extract_plain, is_plain


@hookimpl(trylast=True)
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
