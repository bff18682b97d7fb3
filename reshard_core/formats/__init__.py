"""Model formats: map each framework's parameters onto logical (HF checkpoint) tensors.

See ``base`` for the idea, ``pieces`` for the moves a format is built from, ``cuts`` for the
language an engine format (parameters without layout metadata) is written in, ``registry`` for how
``refit`` finds a model's format, one module per framework for the built-in formats (``megatron``
with ``megatron_config``, ``transformers``, ``vllm`` with ``vllm_parallel`` and ``vllm_blocks``), and
``families/`` for what differs from one model family to another, one file per family.
"""

from __future__ import annotations

from .base import CanonicalFormat, FormatSpecs, ModelFormat
from .families import FAMILIES, Family, family_of, model_types, routed_experts
from .registry import available_formats, declare_format, format_named, resolve_format
from .vllm import VOCAB_PADDING, VLLMFormat, declare_vllm
from .vllm_parallel import VLLMParallel

__all__ = [
    "FAMILIES",
    "CanonicalFormat",
    "Family",
    "FormatSpecs",
    "ModelFormat",
    "VLLMFormat",
    "VLLMParallel",
    "VOCAB_PADDING",
    "available_formats",
    "declare_format",
    "declare_vllm",
    "family_of",
    "format_named",
    "model_types",
    "resolve_format",
    "routed_experts",
]
