"""Megatron-Core ``GPTModel``: fused, padded parameters mapped onto HF checkpoint tensors.

The Megatron extractor lays out each parameter (TP/EP/DP groups, global layer and expert indices:
``decoder.layers.{L}``, ``...local_experts.{e}``, TE grouped ``...experts.linear_fc1.weight{e}``);
this format says which logical (HF checkpoint) tensors each one holds, as views (formats.md):

======================================================  =============================================
Megatron (``decoder.layers.L.`` → ``model.layers.L.``)   logical
======================================================  =============================================
``embedding.word_embeddings.weight`` [V_pad, H]         ``model.embed_tokens.weight`` [V, H] (unpad)
``output_layer.weight``                                 ``lm_head.weight`` (unpad); tied: another
                                                        replica of ``model.embed_tokens.weight``
``decoder.final_layernorm.weight``                      ``model.norm.weight``
``input_layernorm.weight``,                             ``input_layernorm.weight``
``self_attention.linear_qkv.layer_norm_weight``
``self_attention.linear_qkv.{weight,bias}``             ``self_attn.{q,k,v}_proj.*`` (group-major
                                                        blocks of ``(p+2)·h`` rows: regroup)
``self_attention.linear_proj.{weight,bias}``            ``self_attn.o_proj.*``
``self_attention.{q,k}_layernorm.weight``               ``self_attn.{q,k}_norm.weight``
``pre_mlp_layernorm.weight``,                           ``post_attention_layernorm.weight``
``mlp.linear_fc1.layer_norm_weight``
``mlp.linear_fc1.{weight,bias}`` (gated)                ``mlp.{gate,up}_proj.*`` (stride-2 split);
                                                        not gated: ``mlp.up_proj.*``
``mlp.linear_fc2.{weight,bias}``                        ``mlp.down_proj.*``
``mlp.router.weight`` / ``mlp.router.expert_bias``      ``mlp.gate.weight`` /
                                                        ``mlp.gate.e_score_correction_bias``
``mlp.experts.local_experts.{e}.linear_fc{1,2}.*``,     ``mlp.experts.{e}.{gate,up,down}_proj.*``
``mlp.experts.linear_fc{1,2}.{weight,bias}{e}``
``mlp.shared_experts.linear_fc{1,2}.*``                 ``mlp.shared_experts.{gate,up,down}_proj.*``
``mtp.layers.{k}.{enorm,hnorm,eh_proj}.weight``         ``model.layers.{N+k}.{enorm,hnorm,eh_proj}.weight``
``mtp.layers.{k}.final_layernorm.weight``               ``model.layers.{N+k}.shared_head.norm.weight``
``mtp.layers.{k}.transformer_layer.*``                  ``model.layers.{N+k}.*`` (as a decoder layer)
======================================================  =============================================

``N`` is ``num_layers`` (DeepSeek-V3's multi-token-prediction naming). Anything else (learned
position embeddings, LayerNorm biases, multi-latent attention, a shared-expert gate) is returned as
unmapped, which a refit reports as one error listing every name.

The vocab: Megatron pads it (``make_vocab_size_divisible_by · TP``) and the model only knows the
padded size. ``MegatronFormat(vocab_size=V)`` names the real one: rows ≥ V are padding, never sent,
zero-filled once on a destination. Without it the model's vocab is taken as the real one.

``megatron_logical_specs(spec, config, rank)`` is the mapping with no model (``spec.tensor`` may be
None), for offline planning; ``MegatronFormat(config=...).map_offline(spec)`` wraps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import FormatError
from ..extract import ExtractContext
from ..specs import TensorSpec
from .base import ModelFormat
from .pieces import regroup, rename, split, unpad

Mapped = TensorSpec | tuple[TensorSpec, torch.Tensor | None]
"""A logical spec, or a ``(spec, local padding)`` pair from ``unpad``."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_FFN = re.compile(
    r"^mlp\.(?P<where>shared_experts\.|experts\.local_experts\.(?P<e>\d+)\.|)"
    r"linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)$"
)
_GROUPED = re.compile(r"^mlp\.experts\.linear_fc(?P<fc>[12])\.(?P<kind>weight|bias)(?P<e>\d+)$")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")

_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_MTP_RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
_MTP_INNER = ("transformer_layer.", "mtp_model_layer.")
_WRAPPERS = ("DistributedDataParallel", "Float16Module", "FP8Module", "FP4Module")


@dataclass(frozen=True)
class MegatronConfig:
    """What the mapping needs to know of a Megatron model.

    ``vocab_size``: the real (unpadded) vocab, or None to take the model's as real.
    ``num_layers``: decoder layers (names multi-token-prediction layers ``N + k``; None: MTP unmapped).
    """

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    gated_linear_unit: bool = True
    share_embeddings_and_output_weights: bool = False
    num_layers: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of(cls, config: Any, *, vocab_size: int | None = None, tied: bool | None = None) -> MegatronConfig:
        """From a ``TransformerConfig`` (or anything with its field names, or a ``MegatronConfig``);
        ``vocab_size`` and ``tied`` override. ``FormatError`` for an attention output gate (not
        mapped) or inconsistent heads. Norm weights move as stored: with
        ``layernorm_zero_centered_gamma`` the other side must store ``w − 1`` too (Gemma, Qwen3-Next)."""
        if isinstance(config, MegatronConfig):
            base = config
        else:
            if getattr(config, "attention_output_gate", False):
                raise FormatError(
                    "format 'megatron': attention_output_gate=True puts each query group's gates after its "
                    "query heads, where HF's q_proj interleaves them per head; not mapped"
                )
            heads = int(config.num_attention_heads)
            kv = getattr(config, "kv_channels", None) or int(config.hidden_size) // heads
            layers = getattr(config, "num_layers", None)
            base = cls(
                num_attention_heads=heads,
                num_query_groups=int(getattr(config, "num_query_groups", None) or heads),
                kv_channels=int(kv),
                gated_linear_unit=bool(getattr(config, "gated_linear_unit", False)),
                share_embeddings_and_output_weights=bool(
                    getattr(config, "share_embeddings_and_output_weights", False)
                ),
                num_layers=int(layers) if layers is not None else None,
            )
        if vocab_size is not None:
            base = replace(base, vocab_size=int(vocab_size))
        if tied is not None:
            base = replace(base, share_embeddings_and_output_weights=bool(tied))
        if base.num_attention_heads % base.num_query_groups:
            raise FormatError(
                f"format 'megatron': num_attention_heads={base.num_attention_heads} is not a multiple "
                f"of num_query_groups={base.num_query_groups}"
            )
        return base

    @property
    def qkv_block(self) -> int:
        """Rows of one query group in ``linear_qkv``: ``(p + 2)·h``."""
        return (self.num_attention_heads // self.num_query_groups + 2) * self.kv_channels


def megatron_logical_specs(spec: TensorSpec, config: MegatronConfig, rank: int | None) -> list[Mapped] | None:
    """The logical specs (``(spec, padding)`` pairs for a padded vocab) that Megatron parameter
    ``spec`` (global name, shape and layout, as the Megatron extractor gives them) holds on
    ``rank``; None when the name has no logical tensor. ``spec.tensor`` may be None (layout math
    only); ``rank=None`` then gives every logical layout with no local piece."""
    name = spec.meta.name
    r = -1 if rank is None else rank
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        tied = name.startswith("output") and config.share_embeddings_and_output_weights
        logical = "lm_head.weight" if name.startswith("output") and not tied else "model.embed_tokens.weight"
        return [_vocab(spec, logical, config, r)]
    if name == "decoder.final_layernorm.weight":
        return [rename(spec, "model.norm.weight")]
    found = _LAYER.match(name)
    if found:
        return _layer(spec, f"model.layers.{found[1]}.", found[2], config, r)
    found = _MTP.match(name)
    if found and config.num_layers is not None:
        prefix, rest = f"model.layers.{config.num_layers + int(found[1])}.", found[2]
        if rest in _MTP_RENAMES:
            return [rename(spec, prefix + _MTP_RENAMES[rest])]
        for inner in _MTP_INNER:
            if rest.startswith(inner):
                return _layer(spec, prefix, rest[len(inner) :], config, r)
    return None


def _vocab(spec: TensorSpec, logical: str, config: MegatronConfig, rank: int) -> Mapped:
    padded = spec.meta.shape[0]
    if config.vocab_size is None or config.vocab_size == padded:
        return rename(spec, logical)
    if config.vocab_size > padded:
        raise FormatError(
            f"{spec.meta.name} has {padded} rows, fewer than the real vocab_size={config.vocab_size} "
            f"given to format 'megatron'"
        )
    return unpad(spec, 0, config.vocab_size, logical, rank)


def _layer(
    spec: TensorSpec, prefix: str, rest: str, config: MegatronConfig, rank: int
) -> list[Mapped] | None:
    if rest in _LAYER_RENAMES:
        return [rename(spec, prefix + _LAYER_RENAMES[rest])]
    if rest in _QKV:
        return _qkv(spec, prefix, rest.rsplit(".", 1)[1], config, rank)
    found = _FFN.match(rest) or _GROUPED.match(rest)
    if found is None:
        return None
    if found["e"] is not None:
        where = f"mlp.experts.{int(found['e'])}."
    else:
        where = "mlp.shared_experts." if found.groupdict().get("where") else "mlp."
    kind = found["kind"]
    if found["fc"] == "2":
        return [rename(spec, f"{prefix}{where}down_proj.{kind}")]
    if not config.gated_linear_unit:
        return [rename(spec, f"{prefix}{where}up_proj.{kind}")]
    half = spec.meta.shape[0] // 2
    parts = [(f"{prefix}{where}gate_proj.{kind}", half), (f"{prefix}{where}up_proj.{kind}", half)]
    return list(split(spec, 0, parts, rank))


def _qkv(spec: TensorSpec, prefix: str, kind: str, config: MegatronConfig, rank: int) -> list[Mapped]:
    """Group-major ``[q heads of group g; k_g; v_g]`` blocks → q/k/v_proj (formats.md)."""
    nh, ng, h = config.num_attention_heads, config.num_query_groups, config.kv_channels
    p, block = nh // ng, config.qkv_block
    if spec.meta.shape[0] != ng * block:
        raise FormatError(
            f"{spec.meta.name} has {spec.meta.shape[0]} rows; num_query_groups·(heads/groups + 2)"
            f"·kv_channels = {ng}·{p + 2}·{h} = {ng * block}"
        )
    pieces = (("q_proj", 0, p * h), ("k_proj", p * h, h), ("v_proj", (p + 1) * h, h))
    return [
        regroup(spec, 0, block, start, size, f"{prefix}self_attn.{x}.{kind}", rank)
        for x, start, size in pieces
    ]


class MegatronFormat(ModelFormat):
    """A Megatron-Core ``GPTModel`` (or a list of its pipeline chunks; DDP/Float16Module unwrapped).

    ``vocab_size``: the real vocab when the model's is padded. ``config``: a ``TransformerConfig``
    (or a ``MegatronConfig``, or an object with the same field names) used instead of the model's,
    and needed by ``map_offline``.
    """

    name = "megatron"
    description = (
        "Megatron-Core GPTModel (group-major linear_qkv, stride-2 fc1, padded vocab, per-expert names)"
    )

    def __init__(self, vocab_size: int | None = None, config: Any = None) -> None:
        self.vocab_size = vocab_size
        self.config = config

    def detect(self, model: Any) -> bool:
        if any(
            c.__name__ == "GPTModel" and c.__module__.startswith("megatron.") for c in type(model).__mro__
        ):
            return True
        config = getattr(model, "config", None)
        return (
            hasattr(model, "decoder")
            and (hasattr(model, "embedding") or hasattr(model, "output_layer"))
            and any(c.__name__ == "TransformerConfig" for c in type(config).__mro__)
        )

    def config_of(self, model: Any) -> MegatronConfig:
        """The mapping's config: ``config`` if given, else the model's, with ``vocab_size``."""
        root = _root(model)
        tied = getattr(root, "share_embeddings_and_output_weights", None)
        if self.config is not None:
            given_tied = getattr(self.config, "share_embeddings_and_output_weights", None)
            return MegatronConfig.of(
                self.config, vocab_size=self.vocab_size, tied=tied if given_tied is None else None
            )
        config = getattr(root, "config", None)
        if config is None:
            raise FormatError(f"format 'megatron': {type(root).__name__} has no config; pass config=")
        return MegatronConfig.of(config, vocab_size=self.vocab_size, tied=tied)

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> list[Mapped] | None:
        config = context.cached(("megatron-format", id(self), id(model)), lambda: self.config_of(model))
        return megatron_logical_specs(spec, config, context.rank)

    def map_offline(self, spec: TensorSpec, rank: int | None = None) -> list[TensorSpec] | None:
        """The logical specs of one physical spec by the given ``config`` (no model, no padding views)."""
        if self.config is None:
            raise FormatError("format 'megatron': offline mapping needs config=")
        mapped = megatron_logical_specs(
            spec, MegatronConfig.of(self.config, vocab_size=self.vocab_size), rank
        )
        if mapped is None:
            return None
        return [item if isinstance(item, TensorSpec) else item[0] for item in mapped]

    def __repr__(self) -> str:
        return f"<format megatron vocab_size={self.vocab_size}>" if self.vocab_size else "<format megatron>"


def _root(model: Any) -> Any:
    """The first pipeline chunk, DDP / Float16Module wrappers removed."""
    m = model[0] if isinstance(model, (list, tuple)) else model
    while type(m).__name__ in _WRAPPERS and hasattr(m, "module"):
        m = m.module
    return m
