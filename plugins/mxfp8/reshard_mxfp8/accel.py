"""Optional Transformer Engine kernel for MXFP8 quantization of CUDA tensors (the pure path is the oracle).

TE is imported lazily and only when asked for; any failure to import it leaves the pure path in charge.
TE's MXFP8 kernels need compute capability ≥ 10.0 (Blackwell).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .layout import BLOCK, flat_rows, scale_shape, valid_scale_shape

BACKENDS = ("auto", "torch", "te")


@functools.cache
def _te_modules() -> tuple[Any, Any] | None:
    """``(MXFP8Quantizer, tex)`` if Transformer Engine imports, else None."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except Exception:  # TE missing, or present but broken (no CUDA, ABI mismatch): not an error here
        return None
    return MXFP8Quantizer, tex


def te_usable(x: torch.Tensor, *, columnwise: bool) -> str | None:
    """None if TE can quantize ``x``, else the reason it cannot."""
    if not x.is_cuda:
        return "tensor is not on CUDA"
    if flat_rows(x.shape) % BLOCK:
        return f"TE needs prod(shape[:-1]) divisible by {BLOCK}"
    if torch.cuda.get_device_capability(x.device) < (10, 0):
        return "TE MXFP8 kernels need compute capability >= 10.0"
    if _te_modules() is None:
        return "transformer_engine is not importable"
    return None


def choose_backend(x: torch.Tensor, backend: str, *, columnwise: bool) -> str:
    """Resolve ``backend`` ("auto", "torch" or "te") for ``x``; "te" that cannot run is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown MXFP8 backend {backend!r}; expected one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return "torch"
    reason = te_usable(x, columnwise=columnwise)
    if reason is None:
        return "te"
    if backend == "te":
        raise RuntimeError(f"backend 'te' cannot quantize this tensor: {reason}")
    return "torch"


def te_quantize(x: torch.Tensor, *, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with TE's ``MXFP8Quantizer``; same contract as ``format.quantize`` (padding zeroed)."""
    modules = _te_modules()
    if modules is None:
        raise RuntimeError("transformer_engine is not importable")
    quantizer_cls, tex = modules
    q = quantizer_cls(tex.DType.kFloat8E4M3, rowwise=not columnwise, columnwise=columnwise)(x.contiguous())
    if columnwise:
        data, te_scale = q._columnwise_data, q._columnwise_scale_inv
    else:
        data, te_scale = q._rowwise_data, q._rowwise_scale_inv
    # TE allocates the scale padding with at::empty: copy only the valid region into zeros.
    rows, cols = valid_scale_shape(x.shape, columnwise=columnwise)
    scale = torch.zeros(scale_shape(x.shape, columnwise=columnwise), dtype=torch.uint8, device=x.device)
    scale[:rows, :cols] = te_scale.view(torch.uint8)[:rows, :cols]
    return data.view(torch.uint8).view(x.shape), scale
