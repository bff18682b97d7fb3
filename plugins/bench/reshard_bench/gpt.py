"""A pure-torch GPT with Megatron-Core's parameter names, and deterministic, layout-independent values.

The demo and the benchmark need a real model that runs without megatron-core. ``GPT`` holds what
Megatron's ``GPTModel`` (local layer spec, gated MLP) holds, under the same names: word embeddings,
per layer ``input_layernorm``, ``self_attention.linear_qkv`` (query groups packed as Megatron packs
them), ``linear_proj``, ``pre_mlp_layernorm``, a gated ``mlp.linear_fc1`` (``[gate; up]``) and
``linear_fc2``; ``decoder.final_layernorm`` and ``output_layer``. It can be built as one
tensor-parallel rank's shard (``tp > 1``) and as one pipeline stage (a range of global layers; each
layer carries Megatron's 1-based global ``layer_number``).

Values: element ``i`` (row-major global index) of weight ``name`` is
``frac(i·φ + (seed+1)·ρ) − 0.5 + salt(name)`` computed in float64 and rounded once to the dtype, so
any shard of any layout can be filled (``box_values``) and checked without the full tensor.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reshard_core import Layout, Mesh, Shard

_PHI = 0.6180339887498949
_RHO = 0.7548776662466927


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. ``num_query_groups`` divides ``num_heads`` (grouped-query attention)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    ffn_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def qkv_size(self) -> int:
        """Rows of ``linear_qkv``: per query group, its queries then one key and one value head."""
        return (self.num_heads + 2 * self.num_query_groups) * self.head_dim

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> global shape of every weight, in model order."""
        h, out = self.hidden_size, {"embedding.word_embeddings.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_layers):
            p = f"decoder.layers.{i}."
            out.update({
                p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
                p + "self_attention.linear_qkv.weight": (self.qkv_size, h),
                p + "self_attention.linear_qkv.bias": (self.qkv_size,),
                p + "self_attention.linear_proj.weight": (h, h), p + "self_attention.linear_proj.bias": (h,),
                p + "pre_mlp_layernorm.weight": (h,), p + "pre_mlp_layernorm.bias": (h,),
                p + "mlp.linear_fc1.weight": (2 * self.ffn_hidden_size, h),
                p + "mlp.linear_fc1.bias": (2 * self.ffn_hidden_size,),
                p + "mlp.linear_fc2.weight": (h, self.ffn_hidden_size), p + "mlp.linear_fc2.bias": (h,),
            })  # fmt: skip
        out.update({
            "decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,),
            "output_layer.weight": (self.vocab_size, h),
        })  # fmt: skip
        return out

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the whole model in ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(math.prod(s) for s in self.tensors().values()) * itemsize


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=1024, hidden_size=64, num_layers=4, num_heads=8, num_query_groups=4,
                      ffn_hidden_size=176),
    "small": GPTConfig(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, num_query_groups=4,
                       ffn_hidden_size=704),
    "bench": GPTConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_query_groups=8,
                       ffn_hidden_size=4096),
}  # fmt: skip
"""``tiny`` (~0.6 MB in bf16) and ``small`` (~13 MB) for the demo; ``bench`` (~0.38 GB in bf16) is
the benchmark's default: hidden 1024, 8 layers, vocab 32000."""

_TP_PLACEMENTS = {
    "embedding.word_embeddings.weight": Shard(0),  # vocab-parallel
    "output_layer.weight": Shard(0),
    "self_attention.linear_qkv.weight": Shard(0),  # column-parallel, whole query groups per rank
    "self_attention.linear_qkv.bias": Shard(0),
    "self_attention.linear_proj.weight": Shard(1),  # row-parallel
    "mlp.linear_fc1.weight": Shard(0, stride=2),  # each rank holds [gate_r; up_r]
    "mlp.linear_fc1.bias": Shard(0, stride=2),
    "mlp.linear_fc2.weight": Shard(1),
}


def tp_placement(name: str) -> Shard | None:
    """Megatron's tensor-parallel split of weight ``name`` (None: replicated over the TP group)."""
    for suffix, placement in _TP_PLACEMENTS.items():
        if name == suffix or name.endswith("." + suffix):
            return placement
    return None


def salt(name: str) -> float:
    """A per-weight constant in [-5, 5) derived from its canonical name (a swapped weight shows)."""
    return (zlib.crc32(name.encode()) % 1000) / 100.0 - 5.0


def box_values(
    name: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Values of the region ``offsets``/``sizes`` of weight ``name`` (global ``shape``)."""
    index = torch.zeros((), dtype=torch.float64)
    stride = 1
    for dim in reversed(range(len(shape))):
        coord = torch.arange(offsets[dim], offsets[dim] + sizes[dim], dtype=torch.float64)
        index = index + (coord * stride).reshape([-1] + [1] * (len(shape) - 1 - dim))
        stride *= shape[dim]
    values = torch.frac(index * _PHI + (seed + 1) * _RHO) - 0.5 + salt(name)
    return values.to(dtype).expand(sizes).contiguous()


def fill_local(
    tensor: torch.Tensor, name: str, shape: tuple[int, ...], layout: Layout, rank: int, seed: int
) -> None:
    """Write the values of ``rank``'s holding of ``name`` under ``layout`` into ``tensor`` (local)."""
    with torch.no_grad():
        for box in layout.boxes(shape, rank):
            region(tensor, box.local_offsets, box.sizes).copy_(
                box_values(name, shape, box.offsets, box.sizes, seed, tensor.dtype)
            )


def expected_local(
    name: str, shape: tuple[int, ...], layout: Layout, rank: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """The local tensor ``rank`` holds of ``name`` under ``layout`` when built from ``seed``."""
    out = torch.empty(layout.local_shape(shape, rank), dtype=dtype)
    fill_local(out, name, shape, layout, rank, seed)
    return out


def region(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """The view ``tensor[offsets : offsets + sizes]`` (per dim)."""
    return tensor[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def tp_layout(name: str, tp_ranks: tuple[int, ...]) -> Layout:
    """The layout of ``name`` over one TP group (replicated when Megatron does not split it)."""
    placement = tp_placement(name)
    if placement is None or len(tp_ranks) == 1:
        return Layout.replicated(tp_ranks)
    return Layout(Mesh.of(tp_ranks), (placement,))


# ------------------------------------------------------------------ the module


class SelfAttention(nn.Module):
    def __init__(self, c: GPTConfig, tp: int) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(c.hidden_size, c.qkv_size // tp)
        self.linear_proj = nn.Linear(c.hidden_size // tp, c.hidden_size)


class MLP(nn.Module):
    def __init__(self, c: GPTConfig, tp: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, 2 * c.ffn_hidden_size // tp)
        self.linear_fc2 = nn.Linear(c.ffn_hidden_size // tp, c.hidden_size)


class Layer(nn.Module):
    """One transformer layer; ``layer_number`` is Megatron's 1-based global layer number."""

    def __init__(self, c: GPTConfig, tp: int, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm(c.hidden_size)
        self.self_attention = SelfAttention(c, tp)
        self.pre_mlp_layernorm = nn.LayerNorm(c.hidden_size)
        self.mlp = MLP(c, tp)


class Decoder(nn.Module):
    def __init__(self, c: GPTConfig, tp: int, layers: range, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(c, tp, i + 1) for i in layers)
        self.final_layernorm = nn.LayerNorm(c.hidden_size) if last else None


class Embedding(nn.Module):
    def __init__(self, c: GPTConfig, tp: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size // tp, c.hidden_size)


class GPT(nn.Module):
    """A GPT, or one TP shard / pipeline stage of it: ``layers`` are the global layer indices held;
    the embedding lives on the stage holding layer 0, the final norm and output layer on the stage
    holding the last layer. Parameters are created uninitialised (``build`` fills them)."""

    def __init__(self, config: GPTConfig, *, tp: int = 1, layers: range | None = None) -> None:
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        for size, what in (
            (config.vocab_size, "vocab_size"),
            (config.qkv_size, "qkv rows"),
            (config.hidden_size, "hidden_size"),
            (config.ffn_hidden_size, "ffn_hidden_size"),
        ):
            if size % tp:
                raise ValueError(f"{what} {size} does not divide by tp={tp}")
        self.config = config
        first, last = 0 in layers, config.num_layers - 1 in layers
        self.embedding = Embedding(config, tp) if first else None
        self.decoder = Decoder(config, tp, layers, last)
        self.output_layer = (
            nn.Linear(config.hidden_size, config.vocab_size // tp, bias=False) if last else None
        )

    def canonical_names(self) -> dict[str, str]:
        """Local parameter name -> canonical name (stage-local layer index -> global)."""
        out = {}
        for local, _ in self.named_parameters():
            parts = local.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(self.decoder.layers[int(parts[2])].layer_number - 1)
            out[local] = ".".join(parts)
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for ``tokens`` (batch, seq); only for the whole model (TP 1, every layer here)."""
        c = self.config
        x = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            x = x + _attention(layer, layer.input_layernorm(x), c)
            h = layer.mlp.linear_fc1(layer.pre_mlp_layernorm(x))
            gate, up = h.chunk(2, dim=-1)
            x = x + layer.mlp.linear_fc2(F.silu(gate) * up)
        return self.output_layer(self.decoder.final_layernorm(x))


def _attention(layer: Layer, x: torch.Tensor, c: GPTConfig) -> torch.Tensor:
    b, s, _ = x.shape
    per_group = c.num_heads // c.num_query_groups
    qkv = layer.self_attention.linear_qkv(x).view(b, s, c.num_query_groups, per_group + 2, c.head_dim)
    q = qkv[..., :per_group, :].reshape(b, s, c.num_heads, c.head_dim).transpose(1, 2)
    k = qkv[..., per_group, :].repeat_interleave(per_group, dim=2).transpose(1, 2)
    v = qkv[..., per_group + 1, :].repeat_interleave(per_group, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return layer.self_attention.linear_proj(out.transpose(1, 2).reshape(b, s, c.hidden_size))
