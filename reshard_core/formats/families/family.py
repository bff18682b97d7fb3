"""What a model family is: one HF architecture, and how each framework names, fuses and splits it.

The logical space is a family's HF checkpoint names and shapes (``model.layers.0.self_attn.q_proj.weight``).
Each format maps its framework onto that space; the parts that differ from family to family live in
the family's own file (``llama.py``, ``deepseek_v3.py``, ...), so one family can be read, and added,
in one place:

- **vLLM** (``vllm``): the family's vLLM model as blocks of ``vllm_blocks.VLLMBlocks``, one per vLLM
  layer, read from the model's transformers config. The default is a Llama-shaped model whose
  attention and MLP each family states (``vllm_attention``, ``vllm_mlp``).
- **Megatron-Core** (``megatron_*``): Megatron's ``GPTModel`` names are the same for every family;
  a family renames what its HF checkpoint names otherwise (``megatron_names``), maps what only it has
  (``megatron_moves``), and is chosen for a Megatron model by the settings only it uses
  (``megatron_matches``: multi-latent attention is DeepSeek-V3's).
- **transformers in memory** (``hf_moves``): transformers 5 fuses MoE experts into 3-D tensors;
  the default splits ``[E, 2I, H]`` (gate rows first) per expert.

Shared behaviour is the base class's default, a parent family (Qwen3-MoE is Qwen3 with MoE layers)
or a helper of the family that defines it (GLM-4.5 has DeepSeek-V3's MoE layers).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from ...specs import TensorSpec
from ..pieces import select, split
from ..vllm_blocks import VLLMBlocks


def get(config: Any, key: str, default: Any = None) -> Any:
    """``config.key``, or ``default`` when it is missing or None."""
    value = getattr(config, key, None)
    return default if value is None else value


def head_dim(config: Any) -> int:
    """The attention head size: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    return int(get(config, "head_dim") or config.hidden_size // config.num_attention_heads)


class Family:
    """One HF architecture (``model_types``) on every side. Subclasses set the class attributes and
    override the parts in which they differ from a Llama."""

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ vLLM

    vllm_embedding: ClassVar[str] = "model.embed_tokens"
    """vLLM's name of the embedding module (``model.embed_tokens`` in HF's names)."""

    def vllm(self, b: VLLMBlocks, c: Any) -> None:
        """The whole vLLM model of config ``c``: embedding, layers, final norm, head."""
        hidden = c.hidden_size
        b.vocab(self.vllm_embedding, "model.embed_tokens", c.vocab_size, hidden)
        for n in range(c.num_hidden_layers):
            p = f"model.layers.{n}"
            self.vllm_attention(b, c, n, p)
            self.vllm_mlp(b, c, n, p)
            b.norm(f"{p}.input_layernorm", hidden)
            b.norm(f"{p}.post_attention_layernorm", hidden)
        b.norm("model.norm", hidden)
        if not get(c, "tie_word_embeddings", False):
            b.vocab("lm_head", "lm_head", c.vocab_size, hidden)

    def experts(self, c: Any) -> int:
        """How many routed experts a config's MoE layers have (0: a dense model)."""
        return get(c, "num_experts", 0)

    def vllm_attention(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        """Layer ``n``'s attention (``p``: ``model.layers.{n}``): GQA, ``qkv_proj`` and ``o_proj`` with
        the biases ``attention_biases`` says, and per-head q/k norms when ``qk_norms`` says so."""
        h, (qkv_bias, o_bias) = head_dim(c), self.attention_biases(c)
        heads, kv = c.num_attention_heads, get(c, "num_key_value_heads", c.num_attention_heads)
        b.qkv(f"{p}.self_attn.qkv_proj", f"{p}.self_attn", heads, kv, h, c.hidden_size, bias=qkv_bias)
        b.row(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", c.hidden_size, heads * h, bias=o_bias)
        if self.qk_norms(c):
            b.norm(f"{p}.self_attn.q_norm", h)
            b.norm(f"{p}.self_attn.k_norm", h)

    def attention_biases(self, c: Any) -> tuple[bool, bool]:
        """Whether vLLM's attention of config ``c`` has (q/k/v biases, an ``o_proj`` bias)."""
        return False, False

    def qk_norms(self, c: Any) -> bool:
        """Whether vLLM's attention of config ``c`` has per-head q/k RMSNorms."""
        return False

    def vllm_mlp(self, b: VLLMBlocks, c: Any, n: int, p: str) -> None:
        """Layer ``n``'s MLP: a gated dense one of ``intermediate_size``."""
        b.mlp(f"{p}.mlp", f"{p}.mlp", c.intermediate_size, c.hidden_size)

    # ------------------------------------------------------------------ Megatron-Core

    megatron_names: ClassVar[dict[str, str]] = {}
    """Megatron names inside a layer (after ``decoder.layers.L.``) whose logical name (after
    ``model.layers.L.``) is another than the shared table's, or that only this family has."""
    megatron_shared_expert: ClassVar[str] = "mlp.shared_experts."
    """The logical prefix of Megatron's ``mlp.shared_experts`` (DeepSeek-V3's plural by default)."""
    megatron_activations: ClassVar[tuple[str, ...]] = ("silu",)
    """The activations of this family's gated MLPs (``TransformerConfig.activation_func``)."""

    megatron_settings: ClassVar[tuple[tuple[str, object], ...]] = ()
    """``(TransformerConfig field, value)`` that only this family uses: a Megatron model with any of
    them is of this family, and the format maps them (other families refuse those that change
    weights, ``megatron_config.REFUSED``)."""

    def megatron_matches(self, config: Any) -> bool:
        """Whether a Megatron ``TransformerConfig`` is of this family (by a setting only it uses)."""
        return any(getattr(config, field, None) == value for field, value in self.megatron_settings)

    def megatron_refusal(self, config: Any) -> str:
        """Why a Megatron config of this family has no mapping ("" when it has one)."""
        return ""

    def megatron_moves(
        self, spec: TensorSpec, prefix: str, rest: str, config: Any, rank: int
    ) -> list[TensorSpec] | None:
        """This family's own moves for Megatron parameter ``rest`` of a layer (``prefix``: its logical
        ``model.layers.L.``), before the shared table; None: the shared table maps it."""
        return None

    # ------------------------------------------------------------------ transformers in memory

    def hf_refusal(self, config: Any) -> str:
        """Why a transformers config of this family has no mapping ("" when it has one)."""
        return ""

    def hf_moves(self, spec: TensorSpec, rank: int) -> list[TensorSpec] | None:
        """The logical specs of a transformers 5 tensor; None: it has its logical name already.
        Default: fused experts ``...experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
        ``...experts.down_proj [E, H, I]``, split per expert."""
        name = spec.meta.name
        if name.endswith(".experts.gate_up_proj") and len(spec.meta.shape) == 3:
            prefix, inter = name[: -len("gate_up_proj")], spec.meta.shape[1] // 2
            out = []
            for e in range(spec.meta.shape[0]):
                expert = select(spec, 0, e, f"{prefix}{e}.gate_up_proj", rank)
                if expert is not None:
                    parts = [(f"{prefix}{e}.gate_proj.weight", inter), (f"{prefix}{e}.up_proj.weight", inter)]
                    out += split(expert, 0, parts, rank)
            return out
        if name.endswith(".experts.down_proj") and len(spec.meta.shape) == 3:
            prefix = name[: -len("down_proj")]
            picked = (
                select(spec, 0, e, f"{prefix}{e}.down_proj.weight", rank) for e in range(spec.meta.shape[0])
            )
            return [s for s in picked if s is not None]
        return None

    # ------------------------------------------------------------------ offline planning

    def hf_config(self, cfg: Any) -> SimpleNamespace:
        """A transformers-style config of this family from a catalogue ``GPTConfig`` (what the vLLM
        side of ``reshard plan`` reads): the Llama/Qwen fields; families add theirs."""
        return SimpleNamespace(
            model_type=cfg.family or self.model_types[0], vocab_size=cfg.vocab, hidden_size=cfg.hidden,
            num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim or cfg.hidden // cfg.heads, intermediate_size=cfg.ffn,
            num_hidden_layers=cfg.layers, num_experts=cfg.experts, moe_intermediate_size=cfg.moe_ffn,
            mlp_only_layers=list(range(cfg.first_dense_layers)), tie_word_embeddings=cfg.tied,
            attention_bias=cfg.qkv_bias, dtype="bfloat16",
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"<family {self.name}>"


FP32 = torch.float32
