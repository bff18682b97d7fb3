"""What a model format is: a convention for naming, fusing and padding a model's weights.

Refitting across conventions (Megatron-Core training → an inference engine's fused, padded
parameters) goes through one **logical space**: the HF checkpoint names and shapes every framework
converts to and from (``model.layers.0.self_attn.q_proj.weight``, ``[nh·h, H]``). A format
describes each of this rank's physical tensors as logical specs — a logical name, the logical
tensor's layout over ranks, and the local piece as a view of the parameter — so the planner,
validation and the executor run unchanged, in logical space, moving only the slices each
destination needs. Layouts still describe how ranks share a tensor; a format only says which
logical tensor a view of a parameter is.

Formats are plugins (hook ``reshard_formats``); ``detect`` lets ``refit`` find one for a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..extract import ExtractContext, extract_specs
from ..specs import TensorSpec


@dataclass
class FormatSpecs:
    """This rank's logical view of one model.

    ``specs``: logical tensor specs (local tensors are views of the model's parameters).
    ``padding``: local regions of parameters that no logical element maps to (vocab padding); a
    destination zero-fills them once, a source never reads them.
    ``unmapped``: physical tensor names the format has no logical tensor for (an error, listed).
    """

    specs: list[TensorSpec] = field(default_factory=list)
    padding: list[torch.Tensor] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


class ModelFormat:
    """A naming/fusing/padding convention. Subclasses set ``name`` and ``description`` and implement
    ``detect`` and ``logical_specs`` (or ``map_spec``, for formats whose parameters the built-in
    extractors already lay out: DTensor, Megatron attributes, ``declare_layout``)."""

    name: str = ""
    description: str = ""

    def model_types(self) -> tuple[str, ...] | None:
        """The HF ``model_type``s whose weights this format maps (``reshard formats list``); None: any
        model, whatever its type (a format that keeps names as they are)."""
        return None

    def detect(self, model: Any) -> bool:
        """True when ``model`` (a module, or a list of pipeline chunks) is in this format."""
        return False

    def logical_specs(self, model: Any, side: str, context: ExtractContext) -> FormatSpecs:
        """This rank's logical specs of ``model``: by default, each physical spec the extractors
        find, mapped by ``map_spec``."""
        out = FormatSpecs()
        for spec in extract_specs(model, side, context=context):
            mapped = self.map_spec(spec, model, context)
            if mapped is None:
                out.unmapped.append(spec.meta.name)
                continue
            for item in mapped:
                if isinstance(item, TensorSpec):
                    out.specs.append(item)
                elif item is not None:  # a (spec, padding) pair from ``pieces.unpad``
                    logical, pad = item
                    out.specs.append(logical)
                    if pad is not None:
                        out.padding.append(pad)
        return out

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> Iterable[Any] | None:
        """Logical specs (or ``(spec, padding)`` pairs; ``None`` items are dropped) for one physical
        spec; None when the format has no mapping for it."""
        raise NotImplementedError(f"format {self.name!r} implements neither logical_specs nor map_spec")

    def __repr__(self) -> str:
        return f"<format {self.name}>"


class CanonicalFormat(ModelFormat):
    """Tensors already carry their logical (HF checkpoint) names: the identity mapping.

    Use it (``dst_format="hf-checkpoint"``) for a custom engine that names its plain tensors like
    an HF checkpoint and lays them out with ``declare_layout``.
    """

    name = "hf-checkpoint"
    description = "tensors named and shaped like an HF checkpoint (identity mapping)"

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> list[TensorSpec]:
        return [spec]
