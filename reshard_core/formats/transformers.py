"""transformers 5 models in memory: HF checkpoint names, except fused MoE experts.

transformers 5 holds an MoE layer's experts fused in 3-D tensors, where its checkpoints (the logical
space) name ``mlp.experts.{e}.{gate,up,down}_proj.weight``; the model's family (``families/``, by
``config.model_type``) says how to split them (``Family.hf_moves``: most families hold
``gate_up_proj [E, 2I, H]``, gate rows first, and ``down_proj [E, H, I]``; GPT-OSS interleaves gate and
up columns of an input-major ``[E, H, 2I]``). Everything else already has its checkpoint name; a
model type no family knows gets the default split. The built-in extractors lay the parameters out
(FSDP2 / DTensor placements, or replicated).
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ..extract import ExtractContext, unwrap_all
from ..specs import TensorSpec
from .base import ModelFormat
from .families import FAMILIES, Family


class TransformersFormat(ModelFormat):
    """A ``transformers.PreTrainedModel`` in memory (FSDP2- or DTensor-sharded, or replicated)."""

    name = "hf"
    description = "transformers 5 models in memory (HF names; fused MoE experts split per expert)"

    def detect(self, model: Any) -> bool:
        return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) and hasattr(
            model, "config"
        )

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> list[TensorSpec] | None:
        family = context.cached(("hf-family", id(model)), lambda: _family(model))
        moved = family.hf_moves(spec, context.rank)
        return [spec] if moved is None else moved


def _family(model: Any) -> Family:
    """The family of the module detection looked at (by ``config.model_type``), else the default;
    ``FormatError`` when its family refuses the config."""
    roots = unwrap_all(model)
    config = getattr(roots[0], "config", None) if roots else None
    model_type = getattr(config, "model_type", None)
    family = next((f for f in FAMILIES if model_type in f.model_types), Family())
    refusal = family.hf_refusal(config)
    if refusal:
        raise FormatError(refusal)
    return family
