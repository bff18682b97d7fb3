"""vLLM's (and SGLang's) parameter convention: fused, padded, per-rank parameters without metadata.

An engine in vLLM's convention holds on each rank (vLLM's ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``; TP size ``T``, TP rank ``d``):

- ``model.embed_tokens.weight`` and ``lm_head.weight`` (absent when tied): ``[V_pad/T, H]``,
  ``V_pad = ceil(V/64)·64``; rank d holds padded rows ``[d·V_pad/T, +V_pad/T)``, rows past V are
  padding (zero-filled once on a destination, never sent);
- ``self_attn.qkv_proj.weight`` ``[q_d; k_d; v_d]``: ``nh/T`` query heads, and ``ng/T`` kv heads, or
  when ``T > ng`` one kv head (``d // (T/ng)``) replicated over ``T/ng`` ranks; ``o_proj``
  row-parallel; Qwen3's ``q_norm``/``k_norm`` replicated;
- ``mlp.gate_up_proj.weight`` ``[gate_d; up_d]``, ``down_proj`` row-parallel; norms replicated;
- MoE layers: the router ``mlp.gate.weight`` replicated; ``mlp.experts.w13_weight
  [E_local, 2I/M, H]`` (``[gate; up]`` rows of each local expert) and ``w2_weight [E_local, H, I/M]``.
  Without expert parallelism every rank holds every expert cut over ``M = DP × TP`` ranks (flattened,
  ``dp_rank·T + tp_rank``); with it, ``DP × TP`` ranks hold whole experts, placed "linear" (rank r
  owns ``[r·b + min(r, q), … + b + (r < q))``, ``b = E // P``, ``q = E % P``) or "round_robin".
  Newer vLLM names them ``mlp.experts.routed_experts.*``; both are accepted.

vLLM's layers carry no sharding metadata, so this format derives each logical (HF checkpoint)
tensor's layout from the model's transformers config (``model.config``) and a ``VLLMParallel``
description (``vllm_parallel.py``), and its local piece as a cut of a fused parameter (rows of
``qkv_proj``, ``w13_weight[k, :I_l]``, …: the cut language of ``cuts.py``; this module is only
vLLM's naming, fusion and padding table). The description is the model's ``reshard_vllm_parallel``
attribute, set by ``declare_vllm`` (for a live vLLM worker, ``reshard-vllm`` declares it from vLLM's
own process groups: pipeline parallel size 1, the ranks of vLLM's world).

A custom engine (an SGLang model, a hand-written one) with vLLM's names and per-rank shapes and a
``config`` attribute declares it::

    from reshard_core.formats import VLLMParallel, declare_vllm
    declare_vllm(engine, VLLMParallel.of((0, 1, 2, 3)))
    # = declare_format(engine, "vllm"); engine.reshard_vllm_parallel = VLLMParallel.of((0, 1, 2, 3))

``vllm_logical_specs(config, parallel, rank)`` gives the same logical layouts with no model and no
tensors (``rank=None``: every logical tensor), for an integrator planning offline.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FormatError
from ..extract import ExtractContext, iter_tensors, strip_wrappers, unwrap
from ..specs import TensorSpec
from .base import FormatSpecs, ModelFormat
from .cuts import EngineTable
from .families import family_of, model_types
from .registry import declare_format
from .vllm_blocks import VOCAB_PADDING, VLLMBlocks
from .vllm_parallel import PARALLEL_ATTR, VLLMParallel, parallel_of

__all__ = [
    "PARALLEL_ATTR",
    "VOCAB_PADDING",
    "VLLMFormat",
    "VLLMParallel",
    "declare_vllm",
    "vllm_logical_specs",
    "vllm_param_shapes",
]

_ROUTED = ".experts.routed_experts."


def _table(config: Any, parallel: VLLMParallel, rank: int | None) -> EngineTable:
    """The engine table of ``rank`` (None: every logical tensor) of a vLLM model of ``config``."""
    blocks = VLLMBlocks(parallel, rank)
    family_of(getattr(config, "model_type", None)).vllm(blocks, config)
    return blocks.t


def vllm_logical_specs(
    config: Any, parallel: VLLMParallel, rank: int | None = None, dtype: torch.dtype | None = None
) -> list[TensorSpec]:
    """The logical tensors (HF checkpoint names) of a vLLM engine with ``config`` laid out as
    ``parallel``, as specs without tensors: every one when ``rank`` is None, else those ``rank`` holds.

    ``dtype`` defaults to the config's ``dtype``, else bfloat16. Raises
    ``FormatError`` for a model type or a size the convention cannot split.
    """
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.bfloat16
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    return _table(config, parallel, rank).specs(dtype)


def vllm_param_shapes(config: Any, parallel: VLLMParallel, rank: int) -> dict[str, tuple[int, ...]]:
    """vLLM's parameter names on ``rank`` and their local shapes under this convention."""
    return dict(_table(config, parallel, rank).params)


def declare_vllm(model: Any, parallel: VLLMParallel) -> Any:
    """Declare ``model`` (an engine with vLLM's names and shapes and a ``config``) in format "vllm"
    laid out as ``parallel``; return it."""
    setattr(unwrap(model), PARALLEL_ATTR, parallel)
    return declare_format(model, "vllm")


class VLLMFormat(ModelFormat):
    """vLLM's per-rank fused, padded parameters; layouts from the config and a ``VLLMParallel``."""

    name = "vllm"
    description = "vLLM/SGLang engines: fused qkv/gate_up/w13, padded vocab; layouts from config + parallel"

    def model_types(self) -> tuple[str, ...]:
        return model_types()

    def detect(self, model: Any) -> bool:
        return any(c.__module__.startswith("vllm.") for c in type(model).__mro__)

    def logical_specs(self, model: Any, side: str, context: ExtractContext) -> FormatSpecs:
        """Views of this rank's parameters as logical tensors, and the vocab padding rows.

        Raises ``FormatError`` naming every parameter the config and parallel description imply
        that the model lacks or holds with another local shape. Parameters and floating-point
        buffers the convention does not know are returned as ``unmapped``; integer buffers (vLLM's
        expert maps) and attention layers' kv-cache scales are no weights and are left alone.
        """
        model = _one_model(model)
        return self.resolve(model, dict(weights_of(model)), context.rank)

    def resolve(self, model: Any, weights: dict[str, torch.Tensor], rank: int | None) -> FormatSpecs:
        """``logical_specs`` of ``model`` (its config and parallel description) over ``weights``
        (qualname → tensor: the live ones, or meta tensors of the checkpoint layout, which an
        engine checks before any update)."""
        table = _table(getattr(model, "config", None), parallel_of(model), rank)
        params = {}
        for qualname, tensor in weights.items():
            if not isinstance(tensor, torch.nn.Parameter) and not tensor.is_floating_point():
                continue  # an index buffer (FusedMoE's expert map), not a weight
            if _is_runtime_scale(qualname):
                continue  # an attention layer's kv-cache scales (1.0 unless quantized): no weight
            name = strip_wrappers(qualname)
            params[name.replace(_ROUTED, ".experts.") if _ROUTED in name else name] = (qualname, tensor)
        return table.resolve(params)


def weights_of(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``(qualname, tensor)`` of every parameter and persistent buffer of ``model``."""
    return [(qualname, tensor) for qualname, tensor, _ in iter_tensors(model)]


def _one_model(model: Any) -> Any:
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise FormatError(f"format 'vllm': expected one model, got {len(model)} pipeline chunks")
        model = model[0]
    return unwrap(model)


def _is_runtime_scale(qualname: str) -> bool:
    """vLLM's attention layers (``Attention``, MLA's ``MLAAttention``) hold ``_k_scale``, ``_v_scale``,
    ``_q_scale``, ``_prob_scale``; they scale a quantized kv cache, are no checkpoint weights and
    never refit."""
    return qualname.rpartition(".")[2] in _RUNTIME_SCALES


_RUNTIME_SCALES = frozenset({"_k_scale", "_v_scale", "_q_scale", "_prob_scale"})
