"""What format "megatron" needs to know of a Megatron model, and the settings it refuses by name.

``MegatronConfig.of`` reads a ``TransformerConfig`` (or anything with its field names), finds the
model's family (``families``: the one whose settings it uses, e.g. multi-latent attention is
DeepSeek-V3's) and refuses every weight-changing setting with no mapping (``REFUSED``, unless the
family maps it); ``check_model`` refuses the model-level ones outside the config.
docs/formats-audit.md audits every setting.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import FormatError
from .families import FAMILIES, Family

REFUSED: tuple[tuple[str, object, str], ...] = (
    (
        "attention_output_gate",
        True,
        "linear_qkv then holds per query group its query heads, their gates, k and v, which only "
        "Qwen3-Next (experimental_attention_variant='gated_delta_net') maps",
    ),
    ("normalization", "LayerNorm", "the HF families mapped here use RMSNorm, which has no biases"),
    (
        "softmax_type",
        "off-by-one",
        "the HF families mapped here use a plain softmax or GPT-OSS's learned sinks",
    ),
    (
        "experimental_attention_variant",
        "dsa",
        "its sparse-attention indexer (DeepSeek-V3.2) is not mapped, and vLLM's CPU build cannot serve it",
    ),
    ("heterogeneous_block_specs", True, "layers of different shapes or replaced blocks are not mapped"),
    (
        "layernorm_zero_centered_gamma",
        True,
        "its norm weights are stored as w - 1; when the other side stores them so too (Gemma) "
        "pass MegatronFormat(norms_as_stored=True)",
    ),
)
"""``(TransformerConfig field, value, why)``: settings with no mapping, refused by name unless the
model's family maps them (``Family.megatron_settings``). The audit of every field is in
docs/formats-audit.md."""


def refused(field: str, value: object, why: str) -> FormatError:
    """The error for a setting format 'megatron' does not map."""
    return FormatError(f"{field}={value!r} is not supported by format 'megatron': {why}")


@dataclass(frozen=True)
class MegatronConfig:
    """What the mapping needs to know of a Megatron model.

    ``vocab_size``: the real (unpadded) vocab, or None to take the model's as real.
    ``num_layers``: decoder layers (names multi-token-prediction layers ``N + k``; None: MTP unmapped).
    ``rotary_interleaved``: q/k rows hold each head's rotary pairs side by side (regrouped into HF's
    halves). ``family``: the model family whose names the logical tensors take ("" for the shared
    ones of Llama, Qwen2/3, Qwen3-MoE, GLM-4.5, DeepSeek-V3's MoE). ``output_gate``: ``linear_qkv``
    holds each query group's output gates after its query heads (Qwen3-Next).
    """

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    gated_linear_unit: bool = True
    share_embeddings_and_output_weights: bool = False
    num_layers: int | None = None
    vocab_size: int | None = None
    rotary_interleaved: bool = False
    family: str = ""
    output_gate: bool = False
    delta_net: tuple[int, int, int, int] | None = None
    """Gated delta-net layers' (key heads, value heads, key head size, value head size)."""

    @classmethod
    def of(
        cls,
        config: Any,
        *,
        vocab_size: int | None = None,
        tied: bool | None = None,
        norms_as_stored: bool = False,
    ) -> MegatronConfig:
        """From a ``TransformerConfig`` (or anything with its field names, or a ``MegatronConfig``);
        ``vocab_size`` and ``tied`` override. ``FormatError`` naming the field for a setting that is
        not mapped (``REFUSED``; ``norms_as_stored`` accepts zero-centered norm weights, moved as
        stored) or for inconsistent heads."""
        if isinstance(config, MegatronConfig):
            base = config
        else:
            family = family_matching(config)
            for field, value, why in REFUSED:
                if getattr(config, field, None) == value and not (
                    (norms_as_stored and field == "layernorm_zero_centered_gamma")
                    or (field, value) in family.megatron_settings
                ):
                    raise refused(field, value, why)
            refusal = family.megatron_refusal(config)
            if refusal:
                raise FormatError(f"format 'megatron' cannot map this {family.name} model: {refusal}")
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
                rotary_interleaved=bool(getattr(config, "rotary_interleaved", False)),
                family=family.name,
                output_gate=bool(getattr(config, "attention_output_gate", False)),
                delta_net=_delta_net(config),
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
        """Rows of one query group in ``linear_qkv``: ``(p + 2)·h``, ``(2p + 2)·h`` with gates."""
        p = self.num_attention_heads // self.num_query_groups
        return ((2 if self.output_gate else 1) * p + 2) * self.kv_channels


def _delta_net(config: Any) -> tuple[int, int, int, int] | None:
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    fields += ("linear_value_head_dim",)
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    missing = [f for f in fields if not getattr(config, f, None)]
    if missing:
        raise FormatError(
            "format 'megatron' cannot map this qwen3_next model: "
            f"experimental_attention_variant='gated_delta_net' needs {', '.join(missing)}"
        )
    return tuple(int(getattr(config, f)) for f in fields)  # type: ignore[return-value]


def check_model(root: Any, config: Any) -> None:
    """Refuse, by name, model settings outside ``TransformerConfig``'s weight fields that would make
    the mapped model compute something else than its HF family (learned or no position embeddings,
    another gated activation than the family's), or that add weights the mapping has no rule for.
    ``rotary_percent`` adds no weight and is left to agree with the other side (GLM-4.5 rotates half
    of each head)."""
    kind = getattr(root, "position_embedding_type", "rope")
    if kind in ("learned_absolute", "none"):
        why = (
            "its learned position embeddings (embedding.position_embeddings.weight) are not mapped"
            if kind == "learned_absolute"
            else "the HF families mapped here apply RoPE"
        )
        raise refused("position_embedding_type", kind, why)
    activation = getattr(config, "activation_func", None)
    name = getattr(activation, "__name__", repr(activation))
    family = family_matching(config)
    if activation is not None and getattr(config, "gated_linear_unit", False):
        if name not in family.megatron_activations:
            which = f"family {family.name!r}" if family.name else "the HF families mapped here"
            uses = " or ".join(ACTIVATIONS.get(a, a) for a in family.megatron_activations)
            raise refused("activation_func", name, f"the gated MLPs of {which} use {uses}")


ACTIVATIONS = {"silu": "SiLU (SwiGLU)", "quick_gelu": "quick_gelu with a clamp (GPT-OSS's SwiGLU)"}


def family_matching(config: Any) -> Family:
    """The family of a Megatron config: the first whose own settings it uses, else the shared names."""
    return next((f for f in FAMILIES if f.megatron_matches(config)), _SHARED)


def megatron_family(name: str) -> Family:
    """The family called ``name`` ("": the shared names)."""
    return next((f for f in FAMILIES if f.name == name), _SHARED)


_SHARED = Family()
"""The names every family shares (Megatron's ``GPTModel`` as Llama names it)."""
