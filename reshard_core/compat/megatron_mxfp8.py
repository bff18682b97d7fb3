"""Megatron's automatic MXFP8 set-up for a refit destination, done with ``reshard_mxfp8``.

Megatron's ``prepare_swap_model_weights`` quantizes the destination decoder's linear weights into
persistent MXFP8 buffers when the destination config asks for inference-optimized MXFP8
(``config.transformer_impl == "inference_optimized"`` and ``config.fp8_recipe == "mxfp8"``), and
later refits land BF16 slices in those buffers. ``setup_mxfp8`` does the same with
``reshard_mxfp8.make_mxfp8`` (receiver mode: BF16 on the wire, quantized on landing); the plugin's
``reshard_transforms`` hook then attaches the transform on every rank holding such a destination.

Eligible weights: parameters under ``decoder.`` owned by a linear module (class name containing
``Linear``: Megatron's ``ColumnParallelLinear``/``RowParallelLinear`` and the TE linears), with at
least 2 dims and a local last dim divisible by 32 (MXFP8's block). The buffer form follows
``config.inference_grouped_gemm_backend``: ``"flashinfer"`` gives FlashInfer's swizzled scale,
anything else the plain (data, 2-D scale) pair.
"""

from __future__ import annotations

from typing import Any

import torch


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


def mxfp8_form(core: torch.nn.Module) -> str:
    """``reshard_mxfp8`` buffer form for ``core``: ``"flashinfer"`` or ``"pair"``."""
    backend = _value(getattr(core.config, "inference_grouped_gemm_backend", None))
    return "flashinfer" if backend == "flashinfer" else "pair"


def eligible_names(core: torch.nn.Module, group: Any = None) -> list[str]:
    """Canonical names of the decoder linear weights Megatron would quantize (see the module docstring)."""
    from ..extract import ExtractContext, iter_tensors
    from ..extract.builtin import reshard_extract_tensor as builtin_extract

    context = ExtractContext.create(group)
    names = []
    for qualname, tensor, owner in iter_tensors(core):
        if not qualname.startswith("decoder.") or "Linear" not in type(owner).__name__:
            continue
        if not isinstance(tensor, torch.nn.Parameter) or tensor.dim() < 2 or tensor.shape[-1] % 32:
            continue
        specs = builtin_extract(
            qualname=qualname, tensor=tensor, owner=owner, model=core, side="dst", context=context
        )
        if specs and len(specs) == 1:
            names.append(specs[0].meta.name)
    return names


def setup_mxfp8(core: torch.nn.Module | None, group: Any = None) -> dict[str, Any]:
    """Convert ``core``'s eligible weights to persistent MXFP8 destinations when its config asks for
    it; return them by canonical name ({} when it does not ask). Idempotent: a model already holding
    MXFP8 destinations is left as it is and its destinations are returned."""
    if not wants_mxfp8(core):
        return {}
    try:
        from reshard_mxfp8 import destinations_of, make_mxfp8
    except ImportError as exc:
        raise RuntimeError(
            "the destination config asks for inference-optimized MXFP8 "
            "(transformer_impl='inference_optimized', fp8_recipe='mxfp8') but reshard-mxfp8 is not "
            "installed (pip install reshard-mxfp8)"
        ) from exc
    existing = destinations_of(core)
    if existing:
        return existing
    names = eligible_names(core, group)
    if not names:
        return {}
    return make_mxfp8(core, names, form=mxfp8_form(core), mode="receiver", group=group)
