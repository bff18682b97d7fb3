"""Extraction: turn a model into this rank's ``TensorSpec`` list through the ``reshard_extract_tensor`` hook.

Built-in extractors (tried after any plugin's): DTensor (``dtensor.py``), Megatron-style attributes
(``megatron.py``), plain tensors with optional ``declare_layout`` declarations (``plain.py``).
"""

from __future__ import annotations

from .context import ExtractContext, ExtractError, strip_wrappers
from .plain import declare_layout
from .walk import extract_specs, iter_tensors

__all__ = [
    "ExtractContext",
    "ExtractError",
    "declare_layout",
    "extract_specs",
    "iter_tensors",
    "strip_wrappers",
]
