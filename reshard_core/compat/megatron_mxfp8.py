"""The MXFP8 set-up of ``compat.megatron``: a destination config asking for inference-optimized MXFP8
is refused.

Newer Megatron's ``prepare_swap_model_weights`` quantizes the destination decoder's linear weights into
persistent MXFP8 weights when the destination config asks for inference-optimized MXFP8
(``config.transformer_impl == "inference_optimized"`` and ``config.fp8_recipe == "mxfp8"``). reshard
cannot do the same: its MXFP8 destinations (``reshard_mxfp8.make_mxfp8``) put a raw uint8 / float8
buffer where the layer's ``weight`` was, and no Megatron linear consumes that. megatron-core 0.16.1's
inference layers multiply by a dense weight (``InferenceLayerNormColumnParallelLinear.forward`` and
``InferenceRowParallelLinear.forward``: ``torch.matmul(x, self.weight.t())``), as do the local and TE
linears, and later versions take their MXFP8 path only for Megatron's own ``MXFP8Tensor``. The first
forward would fail, so ``setup_mxfp8`` raises ``ReshardError`` instead, before any data moves.

Layers concerned: modules under ``decoder.`` whose class name contains ``Linear`` with a parameter of at
least 2 dims and a last dim divisible by 32 (the weights an MXFP8 set-up would convert). Destinations
the caller installed with ``reshard_mxfp8.make_mxfp8`` (for kernels that read the buffers themselves)
are kept and returned.

This lives in the core, not in reshard-mxfp8: ``compat.megatron`` refuses such a config whether or not
that plugin is installed. It imports nothing from the plugin; it reads an installed destination by the
plugin's marker attribute name.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ReshardError

_MARKER = "_reshard_mxfp8"  # reshard_mxfp8.destinations.MARKER: set on an installed destination's buffer


def _value(x: Any) -> Any:
    """An enum's ``value`` (Megatron stores some config fields as enums), else ``x``."""
    return getattr(x, "value", x)


def wants_mxfp8(core: torch.nn.Module | None) -> bool:
    """True when ``core``'s config asks for inference-optimized MXFP8 weights."""
    config = getattr(core, "config", None)
    return (
        config is not None
        and _value(getattr(config, "transformer_impl", None)) == "inference_optimized"
        and _value(getattr(config, "fp8_recipe", None)) == "mxfp8"
    )


def mxfp8_layers(core: torch.nn.Module) -> list[tuple[str, str]]:
    """``(qualified name, class name)`` of the decoder linears an MXFP8 set-up would convert."""
    found = []
    for qualname, module in core.named_modules():
        if not qualname.startswith("decoder.") or "Linear" not in type(module).__name__:
            continue
        if any(p.dim() >= 2 and p.shape[-1] % 32 == 0 for p in module.parameters(recurse=False)):
            found.append((qualname, type(module).__name__))
    return found


def _installed(core: torch.nn.Module) -> dict[str, Any]:
    """The MXFP8 destinations already installed in ``core`` (``reshard_mxfp8.destinations_of``)."""
    dests = (getattr(t, _MARKER, None) for t in (*core.parameters(), *core.buffers()))
    return {d.name: d for d in dests if d is not None}


def setup_mxfp8(core: torch.nn.Module | None) -> dict[str, Any]:
    """{} when ``core``'s config does not ask for MXFP8 (or it has no linear to convert); the
    destinations the caller installed, if any; otherwise ``ReshardError`` naming the first layer
    and why (see the module docstring). Nothing in ``core`` is changed."""
    if not wants_mxfp8(core):
        return {}
    existing = _installed(core)
    if existing:
        return existing
    layers = mxfp8_layers(core)
    if not layers:
        return {}
    name, cls = layers[0]
    others = f" (and {len(layers) - 1} more linear layers)" if len(layers) > 1 else ""
    raise ReshardError(
        f"cannot set up MXFP8 weights for {name} ({cls}){others}: the destination config asks for "
        "inference-optimized MXFP8 (transformer_impl='inference_optimized', fp8_recipe='mxfp8'), but "
        "Megatron's linear layers multiply by a dense weight (megatron-core 0.16.1: "
        "torch.matmul(x, self.weight.t())) and reshard's MXFP8 buffers in its place would fail at the "
        "first forward; refused before any data moved. Refit BF16 weights (a destination config without "
        "fp8_recipe='mxfp8'), or install MXFP8 destinations with reshard_mxfp8.make_mxfp8 for kernels "
        "that read them"
    )
