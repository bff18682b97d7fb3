"""transformers 5 models in memory: HF checkpoint names, except fused MoE experts.

transformers 5 holds an MoE layer's experts as ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows
first, then up) and ``mlp.experts.down_proj [E, H, I]``; its checkpoints (the logical space) name
``mlp.experts.{e}.{gate,up,down}_proj.weight``. Everything else already has its checkpoint name.
GPT-OSS's interleaved, input-major ``gate_up_proj [E, H, 2I]`` is not mapped (reported unmapped).
The built-in extractors lay the parameters out (FSDP2 / DTensor placements, or replicated).
"""

from __future__ import annotations

from typing import Any

from ..extract import ExtractContext, unwrap_all
from ..specs import TensorSpec
from .base import ModelFormat
from .pieces import select, split

_FUSED = ".experts.gate_up_proj"
_DOWN = ".experts.down_proj"


class TransformersFormat(ModelFormat):
    """A ``transformers.PreTrainedModel`` in memory (FSDP2- or DTensor-sharded, or replicated)."""

    name = "hf"
    description = "transformers 5 models in memory (HF names; fused MoE experts [E, 2I, H] split per expert)"

    def detect(self, model: Any) -> bool:
        return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) and hasattr(
            model, "config"
        )

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> list[TensorSpec] | None:
        name = spec.meta.name
        if name.endswith(_FUSED) and len(spec.meta.shape) == 3:
            roots = unwrap_all(model)  # the module detection looked at
            if roots and getattr(getattr(roots[0], "config", None), "model_type", "") == "gpt_oss":
                return None
            prefix = name[: -len("gate_up_proj")]
            inter = spec.meta.shape[1] // 2
            out = []
            for e in range(spec.meta.shape[0]):
                expert = select(spec, 0, e, f"{prefix}{e}.gate_up_proj", context.rank)
                if expert is not None:
                    parts = [(f"{prefix}{e}.gate_proj.weight", inter), (f"{prefix}{e}.up_proj.weight", inter)]
                    out += split(expert, 0, parts, context.rank)
            return out
        if name.endswith(_DOWN) and len(spec.meta.shape) == 3:
            prefix = name[: -len("down_proj")]
            picked = (
                select(spec, 0, e, f"{prefix}{e}.down_proj.weight", context.rank)
                for e in range(spec.meta.shape[0])
            )
            return [s for s in picked if s is not None]
        return [spec]
