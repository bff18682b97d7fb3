"""The built-in formats, in detection order (offered through ``reshard_core.builtin_hooks``)."""

from __future__ import annotations

from .base import CanonicalFormat, ModelFormat
from .megatron import MegatronFormat
from .transformers import TransformersFormat
from .vllm import VLLMFormat


def builtin_formats() -> list[ModelFormat]:
    """Megatron-Core, transformers (in memory), the vLLM/SGLang convention, HF checkpoint names."""
    return [MegatronFormat(), TransformersFormat(), VLLMFormat(), CanonicalFormat()]
