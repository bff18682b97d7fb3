"""Model formats: map each framework's parameters onto logical (HF checkpoint) tensors.

See ``base`` for the idea, ``pieces`` for the moves a format is built from, ``cuts`` for the
language an engine format (parameters without layout metadata) is written in, ``registry`` for how
``refit`` finds a model's format, and one module per family for the built-in formats (``megatron``
with ``megatron_config``, ``transformers``, ``vllm`` with ``vllm_parallel``).
"""

from __future__ import annotations

from .base import CanonicalFormat, FormatSpecs, ModelFormat
from .registry import available_formats, declare_format, format_named, resolve_format
from .vllm import VOCAB_PADDING, VLLMFormat, declare_vllm
from .vllm_parallel import VLLMParallel

__all__ = [
    "CanonicalFormat",
    "FormatSpecs",
    "ModelFormat",
    "VLLMFormat",
    "VLLMParallel",
    "VOCAB_PADDING",
    "available_formats",
    "declare_format",
    "declare_vllm",
    "format_named",
    "resolve_format",
]
