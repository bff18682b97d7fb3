"""A source/destination model pair in two layouts, with a check of the destination (demo and bench).

``model="gpt"`` is the pure-torch ``GPT`` (``layouts.py``: FSDP2, Megatron-style or declared),
checked against the values its seed gives. ``model="megatron-gpt"`` is Megatron-Core's
``GPTModel`` (local spec, gated MLP; needs megatron-core), checked box by box against a TP1 model
Megatron builds from the source seed on every rank (built once per process and kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reshard_core.simulate import Parallel

from .gpt import GPTConfig
from .layouts import build_model, check_model


@dataclass
class Pair:
    """Both models on this rank (None where a side has nothing here), and ``check()``: one line per
    destination weight that differs from the source (a collective; call it on every rank)."""

    src: Any
    dst: Any
    check: Callable[[], list[str]]
    styles: tuple[str, str]
    dst_elements: int


def build_pair(
    model: str, config: GPTConfig, src: Parallel, dst: Parallel, dtype: torch.dtype, *, seed: int
) -> Pair:
    """Source from ``seed``, destination from ``seed + 1`` (every weight starts out different).
    Collective over the world."""
    if model == "megatron-gpt":
        return _megatron_pair(config, src, dst, dtype, seed)
    s = build_model(config, src, "src", seed=seed, dtype=dtype)
    d = build_model(config, dst, "dst", seed=seed + 1, dtype=dtype)
    elements = sum((h.tensor.to_local() if h.layout is None else h.tensor).numel() for h in d.holdings)
    return Pair(s.model, d.model, lambda: check_model(d, seed), (s.style, d.style), elements)


def megatron_kwargs(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``build_gpt`` arguments for ``config``."""
    return dict(num_layers=config.num_layers, hidden_size=config.hidden_size,
                num_attention_heads=config.num_heads, num_query_groups=config.num_query_groups,
                ffn_hidden_size=config.ffn_hidden_size, vocab_size=config.vocab_size,
                max_sequence_length=64, dtype=dtype)  # fmt: skip


_references: dict[tuple, dict[str, torch.Tensor]] = {}


def _megatron_pair(config: GPTConfig, src: Parallel, dst: Parallel, dtype: torch.dtype, seed: int) -> Pair:
    from reshard_core import extract_specs
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    for par in (src, dst):
        if par.fsdp > 1 or par.ep > 1 or par.cp > 1:
            raise ValueError(f"layout {par}: megatron-gpt is built with tp, pp and dp only")
    init_megatron()
    kwargs = megatron_kwargs(config, dtype)
    s = build_gpt(build_pg_collection(src.tp, src.pp), seed=seed, **kwargs)
    d = build_gpt(build_pg_collection(dst.tp, dst.pp), seed=seed + 1, **kwargs)
    key = (config, seed, dtype)
    if key not in _references:
        ref = build_gpt(build_pg_collection(1, 1), seed=seed, **kwargs)
        _references[key] = {spec.meta.name: spec.tensor for spec in extract_specs(ref, "src")}
    full = _references[key]

    def check() -> list[str]:
        rank, problems = dist.get_rank(), []
        for spec in extract_specs(d, "dst"):
            for box in spec.layout.boxes(spec.meta.shape, rank):
                got = _region(spec.tensor, box.local_offsets, box.sizes)
                if not torch.equal(got, _region(full[spec.meta.name], box.offsets, box.sizes)):
                    problems.append(f"{spec.meta.name}: the region at {box.offsets} differs on rank {rank}")
        return problems

    elements = sum(t.numel() for t in [*d.parameters(), *d.buffers()])
    return Pair(s, d, check, ("megatron-core", "megatron-core"), elements)


def _region(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def megatron_available() -> bool:
    """Whether megatron-core can be imported here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # a missing parent package
        return False
