"""Extraction: turn a model into this rank's ``TensorSpec`` list through the ``reshard_extract_tensor`` hook.

Built-in extractors (tried after any plugin's): DTensor (``dtensor.py``), Megatron-style attributes
(``megatron.py``), plain tensors with optional ``declare_layout`` declarations (``plain.py``).
"""

from __future__ import annotations

from .builtin import reshard_extract_tensor as builtin_extract
from .context import ExtractContext, ExtractError
from .dtensor import dtensor_shape_and_layout, is_dtensor
from .plain import declare_layout
from .unwrap import strip_wrappers, unwrap, unwrap_all
from .walk import extract_specs, iter_tensors, root_modules

__all__ = [
    "ExtractContext",
    "ExtractError",
    "builtin_extract",
    "declare_layout",
    "dtensor_shape_and_layout",
    "extract_specs",
    "is_dtensor",
    "iter_tensors",
    "root_modules",
    "strip_wrappers",
    "unwrap",
    "unwrap_all",
]
