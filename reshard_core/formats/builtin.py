"""The built-in formats, registered as a ``trylast`` hook so any plugin's format comes first."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .base import CanonicalFormat
from .megatron import MegatronFormat
from .transformers import TransformersFormat
from .vllm import VLLMFormat


@hookimpl(trylast=True)
def reshard_formats():
    """Megatron-Core, transformers (in memory), the vLLM/SGLang convention, HF checkpoint names."""
    return [MegatronFormat(), TransformersFormat(), VLLMFormat(), CanonicalFormat()]
