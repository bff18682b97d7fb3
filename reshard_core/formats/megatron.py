"""Megatron-Core ``GPTModel``: fused, padded parameters mapped onto HF checkpoint tensors.

The Megatron extractor lays out each parameter (TP/EP/DP groups, global layer and expert indices:
``decoder.layers.{L}``, ``...local_experts.{e}``, TE grouped ``...experts.linear_fc1.weight{e}``);
this format says which logical (HF checkpoint) tensors each one holds, as views (every Megatron
setting that changes weights, mapped or refused: docs/formats-audit.md):

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
                                                        blocks of ``(p+2)·h`` rows: regroup; TP >
                                                        groups: a rank holds part of one block;
                                                        ``rotary_interleaved``: q/k rows of each head
                                                        regrouped from pairs into halves)
``self_attention.linear_proj.{weight,bias}``            ``self_attn.o_proj.*``
``self_attention.{q,k}_layernorm.weight``               ``self_attn.{q,k}_norm.weight`` (regrouped
                                                        like q/k with ``rotary_interleaved``)
``pre_mlp_layernorm.weight``,                           ``post_attention_layernorm.weight``
``mlp.linear_fc1.layer_norm_weight``
``mlp.linear_fc1.{weight,bias}`` (gated)                ``mlp.{gate,up}_proj.*`` (stride-2 split);
                                                        not gated: ``mlp.up_proj.*``
``mlp.linear_fc2.{weight,bias}``                        ``mlp.down_proj.*``
``mlp.router.weight`` / ``mlp.router.expert_bias``      ``mlp.gate.weight`` /
                                                        ``mlp.gate.e_score_correction_bias``
``mlp.experts.local_experts.{e}.linear_fc{1,2}.*``,     ``mlp.experts.{e}.{gate,up,down}_proj.*``
``mlp.experts.linear_fc{1,2}.{weight,bias}{e}``
``mlp.shared_experts.linear_fc{1,2}.*``                 ``mlp.shared_experts.{gate,up,down}_proj.*``;
                                                        gated (Qwen2-MoE): ``mlp.shared_expert.*``
``mlp.shared_experts.gate_weight``                      ``mlp.shared_expert_gate.weight``
``mtp.layers.{k}.{enorm,hnorm,eh_proj}.weight``         ``model.layers.{N+k}.{enorm,hnorm,eh_proj}.weight``
``mtp.layers.{k}.final_layernorm.weight``               ``model.layers.{N+k}.shared_head.norm.weight``
``mtp.layers.{k}.transformer_layer.*``                  ``model.layers.{N+k}.*`` (as a decoder layer)
======================================================  =============================================

``N`` is ``num_layers`` (DeepSeek-V3's multi-token-prediction naming). A family's own layers
(multi-latent attention, learned softmax offsets, Qwen3-Next's delta-net and gated attention) are
mapped in its file (``families/``). Settings with no mapping (LayerNorm, learned position
embeddings, an output gate outside Qwen3-Next, off-by-one softmax, sparse attention, zero-centered
norm weights outside Qwen3-Next unless ``norms_as_stored``) are refused by name before any data
moves (``megatron_config.py``); docs/formats-audit.md lists every setting that changes weights and
what is done with it. A parameter the table does not name is returned as unmapped,
which a refit reports as one error listing every name.

The vocab: Megatron pads it (``make_vocab_size_divisible_by · TP``) and the model only knows the
padded size. ``MegatronFormat(vocab_size=V)`` names the real one: rows ≥ V are padding, never sent,
zero-filled once on a destination. Without it the model's vocab is taken as the real one.

``megatron_logical_specs(spec, config, rank)`` is the mapping with no model (``spec.tensor`` may be
None), for offline planning; ``MegatronFormat(config=...).map_offline(spec)`` wraps it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import FormatError
from ..extract import ExtractContext, unwrap
from ..specs import TensorSpec
from .base import ModelFormat
from .families import FAMILIES
from .megatron_config import MegatronConfig, check_model, megatron_family
from .pieces import halves, regroup, rename, split, unpad

__all__ = ["MegatronConfig", "MegatronFormat", "megatron_logical_specs"]

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
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")

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
    family = megatron_family(config.family)
    moved = family.megatron_moves(spec, prefix, rest, config, rank)
    if moved is not None:
        return moved
    renamed = family.megatron_names.get(rest) or _LAYER_RENAMES.get(rest)
    if renamed:
        name = prefix + renamed
        if config.rotary_interleaved and rest in _QK_NORMS:  # normalises the head dim rope then rotates
            return [halves(spec, 0, config.kv_channels, name)]
        return [rename(spec, name)]
    if rest in _QKV:
        return _qkv(spec, prefix, rest.rsplit(".", 1)[1], config, rank)
    found = _FFN.match(rest) or _GROUPED.match(rest)
    if found is None:
        return None
    if found["e"] is not None:
        where = f"mlp.experts.{int(found['e'])}."
    elif found.groupdict().get("where"):
        where = family.megatron_shared_expert
    else:
        where = "mlp."
    kind = found["kind"]
    if found["fc"] == "2":
        return [rename(spec, f"{prefix}{where}down_proj.{kind}")]
    if not config.gated_linear_unit:
        return [rename(spec, f"{prefix}{where}up_proj.{kind}")]
    half = spec.meta.shape[0] // 2
    parts = [(f"{prefix}{where}gate_proj.{kind}", half), (f"{prefix}{where}up_proj.{kind}", half)]
    return list(split(spec, 0, parts, rank))


def _qkv(spec: TensorSpec, prefix: str, kind: str, config: MegatronConfig, rank: int) -> list[Mapped]:
    """Group-major ``[q heads of group g; k_g; v_g]`` blocks → q/k/v_proj; with
    ``rotary_interleaved`` each q/k head's rows are regrouped from pairs into halves; with output
    gates (``[q heads; gate heads; k_g; v_g]``) each q_proj head is its query, then its gate."""
    nh, ng, h = config.num_attention_heads, config.num_query_groups, config.kv_channels
    p, block, gates = nh // ng, config.qkv_block, "2·" if config.output_gate else ""
    if spec.meta.shape[0] != ng * block:
        raise FormatError(
            f"{spec.meta.name} has {spec.meta.shape[0]} rows; num_query_groups·({gates}heads/groups + 2)"
            f"·kv_channels = {ng}·{block // h}·{h} = {ng * block}"
        )
    pairs, q = (h if config.rotary_interleaved else 0), (2 if config.output_gate else 1) * p * h
    pieces = (("q_proj", 0, q, pairs), ("k_proj", q, h, pairs), ("v_proj", q + h, h, 0))
    return [
        regroup(spec, 0, block, start, size, f"{prefix}self_attn.{x}.{kind}", rank, pairs_of=rotary,
                gated_heads=h if x == "q_proj" and config.output_gate else 0)
        for x, start, size, rotary in pieces
    ]  # fmt: skip


class MegatronFormat(ModelFormat):
    """A Megatron-Core ``GPTModel`` (or a list of its pipeline chunks; wrappers removed).

    ``vocab_size``: the real vocab when the model's is padded. ``config``: a ``TransformerConfig``
    (or a ``MegatronConfig``, or an object with the same field names) used instead of the model's,
    and needed by ``map_offline``. ``norms_as_stored``: accept ``layernorm_zero_centered_gamma``
    and move its ``w - 1`` norm weights as they are (for a side that stores them so too).
    """

    name = "megatron"
    description = (
        "Megatron-Core GPTModel (group-major linear_qkv, stride-2 fc1, padded vocab, per-expert names)"
    )

    def __init__(
        self, vocab_size: int | None = None, config: Any = None, norms_as_stored: bool = False
    ) -> None:
        self.vocab_size = vocab_size
        self.config = config
        self.norms_as_stored = norms_as_stored

    def model_types(self) -> tuple[str, ...]:
        return tuple(sorted(t for f in FAMILIES for t in f.model_types))

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
            config = MegatronConfig.of(
                self.config,
                vocab_size=self.vocab_size,
                tied=tied if given_tied is None else None,
                norms_as_stored=self.norms_as_stored,
            )
        elif getattr(root, "config", None) is None:
            raise FormatError(f"format 'megatron': {type(root).__name__} has no config; pass config=")
        else:
            config = MegatronConfig.of(
                root.config, vocab_size=self.vocab_size, tied=tied, norms_as_stored=self.norms_as_stored
            )
        check_model(root, self.config if self.config is not None else root.config)
        return config

    def map_spec(self, spec: TensorSpec, model: Any, context: ExtractContext) -> list[Mapped] | None:
        config = context.cached(("megatron-format", id(self), id(model)), lambda: self.config_of(model))
        return megatron_logical_specs(spec, config, context.rank)

    def map_offline(self, spec: TensorSpec, rank: int | None = None) -> list[TensorSpec] | None:
        """The logical specs of one physical spec by the given ``config`` (no model, no padding views)."""
        if self.config is None:
            raise FormatError("format 'megatron': offline mapping needs config=")
        config = MegatronConfig.of(
            self.config, vocab_size=self.vocab_size, norms_as_stored=self.norms_as_stored
        )
        mapped = megatron_logical_specs(spec, config, rank)
        if mapped is None:
            return None
        return [item if isinstance(item, TensorSpec) else item[0] for item in mapped]

    def __repr__(self) -> str:
        return f"<format megatron vocab_size={self.vocab_size}>" if self.vocab_size else "<format megatron>"


def _root(model: Any) -> Any:
    """The first pipeline chunk, wrappers removed (``extract.unwrap``)."""
    return unwrap(model[0] if isinstance(model, (list, tuple)) else model)
