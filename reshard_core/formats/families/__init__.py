"""The model families the formats map, one file each (see ``family.py`` for what a family states).

``FAMILIES`` is every family, in the order Megatron models are matched against them (the most
specific settings first); ``family_of(model_type)`` finds one by its HF ``model_type``.
"""

from __future__ import annotations

from ...errors import FormatError
from . import deepseek_v3, glm4_moe, gpt_oss, llama, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next
from .family import Family

FAMILIES: tuple[Family, ...] = (
    deepseek_v3.FAMILY,
    gpt_oss.FAMILY,
    qwen3_next.FAMILY,
    qwen2_moe.FAMILY,
    glm4_moe.FAMILY,
    qwen3_moe.FAMILY,
    qwen3.FAMILY,
    qwen2.FAMILY,
    llama.FAMILY,
)


def model_types() -> tuple[str, ...]:
    """Every HF ``model_type`` a family knows, sorted."""
    return tuple(sorted(t for family in FAMILIES for t in family.model_types))


def family_of(model_type: str | None, fmt: str = "vllm") -> Family:
    """The family of HF ``model_type``; ``FormatError`` naming format ``fmt`` and the known types."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise FormatError(f"format '{fmt}' knows model types {', '.join(model_types())}, not {model_type!r}")


def routed_experts(config: object) -> int:
    """How many routed experts ``config`` (a transformers config) has, read the way its family reads
    it; 0 for a dense model or a model type no family knows."""
    model_type = getattr(config, "model_type", None)
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    return int(family.experts(config)) if family is not None else 0


__all__ = ["FAMILIES", "Family", "family_of", "model_types", "routed_experts"]
