"""A STAND-IN for Transformer Engine's ``MXFP8Tensor`` on CPU (TE needs CUDA and SM100; fsdp2-te.md D).

``StandInMXFP8Tensor`` is a ``_make_wrapper_subclass`` with ``__torch_dispatch__`` carrying TE's field
names (``_rowwise_data``, ``_rowwise_scale_inv``, ``_columnwise_data``, ``_columnwise_scale_inv``,
``_fp8_dtype``, ``_with_gemm_swizzled_scales``; nominal dtype bf16), quantized with
``reshard_mxfp8.quantize`` (bit-exact with TE), and TE's FSDP2 hooks (fsdp2-te.md C.1/C.2): the
pre-hook gathers ``(data, scale[:rows])`` uint8 pairs, the post-hook re-pads the scale rows with zeros.

Dispatch mimics what ``fully_shard`` needs from TE (C.2): ``split`` along dim 0 stays quantized when
the pieces are equal multiples of 32 rows, else falls back to dequantized plain tensors; ``new_zeros``
(unpadded zero scales; plain when rows % 32 != 0), ``slice``/``as_strided``/``view`` of the full
range and ``detach``/``alias`` are no-ops, ``copy_`` copies planes (or quantizes a plain source).
Anything else dequantizes and runs on plain tensors. Not TE: no quantizer, no usage switching.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reshard_mxfp8 import dequantize, quantize
from reshard_mxfp8.layout import BLOCK

aten = torch.ops.aten
E4M3 = "kFloat8E4M3"  # what str(TE DType) contains


class StandInMXFP8Tensor(torch.Tensor):
    """TE ``MXFP8Tensor`` look-alike (see the module docstring). Either plane may be None."""

    @staticmethod
    def __new__(cls, shape, rowwise=None, columnwise=None, dtype=torch.bfloat16, swizzled=False):
        planes = rowwise or columnwise
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=planes[0].device)
        t._rowwise_data, t._rowwise_scale_inv = rowwise or (None, None)
        t._columnwise_data, t._columnwise_scale_inv = columnwise or (None, None)
        t._fp8_dtype, t._with_gemm_swizzled_scales = E4M3, swizzled
        return t

    @classmethod
    def quantized(cls, x: torch.Tensor, *, rowwise=True, columnwise=False) -> StandInMXFP8Tensor:
        """Quantize ``x`` (TE's padded scales) into the planes asked for."""
        x = x.detach()
        return cls(
            tuple(x.shape), quantize(x) if rowwise else None,
            quantize(x, columnwise=True) if columnwise else None, dtype=x.dtype,
        )  # fmt: skip

    def __repr__(self):
        return f"StandInMXFP8Tensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantize(self, dtype=None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self._rowwise_data is not None:
            return dequantize(self._rowwise_data, self._rowwise_scale_inv, dtype=dtype)
        return dequantize(self._columnwise_data, self._columnwise_scale_inv, columnwise=True, dtype=dtype)

    # FSDP2 extension hooks (fsdp2-te.md C.1/C.2) ------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        rows = self.shape[0]
        out = []
        if self._rowwise_data is not None:
            out += [self._rowwise_data, self._rowwise_scale_inv[:rows]]
        if self._columnwise_data is not None:
            out += [self._columnwise_data, self._columnwise_scale_inv[: rows // BLOCK]]
        return tuple(out), (self._rowwise_data is not None, self._columnwise_data is not None)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        has_row, has_col = metadata
        rows = outputs[0].shape[0]
        row = (outputs[0], _pad_rows(outputs[1], 128)) if has_row else None
        col = (outputs[-2], _pad_rows(outputs[-1], 4)) if has_col else None
        if out is not None:
            _copy_planes(out, StandInMXFP8Tensor((rows, *self.shape[1:]), row, col, self.dtype))
            return None
        return StandInMXFP8Tensor((rows, *self.shape[1:]), row, col, param_dtype or self.dtype), outputs

    # dispatch ---------------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return _like(self, tuple(self.shape))
        if func is aten.split.Tensor and _even_split(self, *args[1:]):
            return [_rows(self, i, args[1]) for i in range(0, self.shape[0], args[1])]
        if func is aten.new_zeros.default and len(args[1]) >= 2 and args[1][0] % BLOCK == 0:
            return _zeros(self, tuple(args[1]))
        no_op = (aten.slice.Tensor, aten.as_strided.default, aten.view.default)
        if func in no_op and _full(func, self, args):
            return _like(self, tuple(self.shape))
        if func is aten.copy_.default and isinstance(self, cls):
            src = args[1]
            _copy_planes(self, src if isinstance(src, cls) else cls.quantized(src, **_usage(self)))
            return self
        plain = torch.utils._pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*plain[0], **plain[1])


def _usage(t) -> dict:
    return {"rowwise": t._rowwise_data is not None, "columnwise": t._columnwise_data is not None}


def _like(t, shape):
    row = (t._rowwise_data, t._rowwise_scale_inv) if t._rowwise_data is not None else None
    col = (t._columnwise_data, t._columnwise_scale_inv) if t._columnwise_data is not None else None
    return StandInMXFP8Tensor(shape, row, col, t.dtype, t._with_gemm_swizzled_scales)


def _even_split(t, size, dim=0) -> bool:
    return dim == 0 and t.shape[0] % size == 0 and size % BLOCK == 0 and not t._with_gemm_swizzled_scales


def _rows(t, start, n):
    """Rows ``[start, start+n)`` (start, n multiples of 32) as a quantized piece: shard locality (A.7)."""
    row = col = None
    if t._rowwise_data is not None:
        row = (t._rowwise_data[start : start + n], _pad_rows(t._rowwise_scale_inv[start : start + n], 128))
    if t._columnwise_data is not None:
        s = t._columnwise_scale_inv[start // BLOCK : (start + n) // BLOCK]
        col = (t._columnwise_data[start : start + n], _pad_rows(s, 4))
    return StandInMXFP8Tensor((n, *t.shape[1:]), row, col, t.dtype)


def _zeros(t, shape):
    """TE's ``new_zeros``: a quantized tensor with UNPADDED scale shapes ``[M, K/32]`` / ``[M/32, K]``."""
    m, k = shape[0], shape[-1]
    u8 = {"dtype": torch.uint8, "device": t.device}
    row = col = None
    if t._rowwise_data is not None:
        row = (torch.zeros(shape, **u8), torch.zeros((m, k // BLOCK), **u8))
    if t._columnwise_data is not None:
        col = (torch.zeros(shape, **u8), torch.zeros((m // BLOCK, k), **u8))
    return StandInMXFP8Tensor(shape, row, col, t.dtype)


def _full(func, t, args) -> bool:
    if func is aten.slice.Tensor:
        dim, start, end = (list(args[1:]) + [0, None, None])[:3]
        return (start or 0) == 0 and (end is None or end >= t.shape[dim])
    return tuple(args[1]) == tuple(t.shape)


def _pad_rows(scale: torch.Tensor, multiple: int) -> torch.Tensor:
    return F.pad(scale, (0, 0, 0, -scale.shape[0] % multiple))


def _copy_planes(dst, src) -> None:
    """Copy ``src``'s planes into ``dst``'s (data whole; the valid region of scales of either padding)."""
    for d, s in (("_rowwise_data", "_rowwise_scale_inv"), ("_columnwise_data", "_columnwise_scale_inv")):
        if getattr(dst, d) is None or getattr(src, d) is None:
            continue
        getattr(dst, d).copy_(getattr(src, d))
        ds, ss = getattr(dst, s), getattr(src, s)
        r, c = min(ds.shape[0], ss.shape[0]), min(ds.shape[1], ss.shape[1])
        ds[:r, :c].copy_(ss[:r, :c])


class StandInFloat8BlockwiseQTensor:
    """Fields of TE's ``Float8BlockwiseQTensor`` (1x128 / 128x128 blocks, fp32 scales): MXFP8-like planes
    plus ``_is_2D_scaled``; enough to check the extractor refuses it."""

    def __init__(self, shape: tuple[int, int], two_d: bool = False) -> None:
        m, k = shape
        self.shape, self.device = shape, torch.device("cpu")
        self._rowwise_data = torch.zeros(shape, dtype=torch.uint8)
        self._rowwise_scale_inv = torch.ones(-(-k // 128), m, dtype=torch.float32)
        self._columnwise_data = torch.zeros(k, m, dtype=torch.uint8)
        self._columnwise_scale_inv = torch.ones(-(-m // 128), k, dtype=torch.float32)
        self._fp8_dtype, self._is_2D_scaled = E4M3, two_d


class StandInNVFP4Tensor:
    """Fields of TE's ``NVFP4Tensor`` (packed E2M1 pairs, E4M3 scales per 16, per-tensor amax): MXFP8-like
    plane names plus ``_fp4_dtype`` and ``_amax_rowwise``; enough to check the extractor refuses it."""

    def __init__(self, shape: tuple[int, int]) -> None:
        m, k = shape
        self.shape, self.device = shape, torch.device("cpu")
        self._rowwise_data = torch.zeros(m, k // 2, dtype=torch.uint8)
        self._rowwise_scale_inv = torch.zeros(m, k // 16, dtype=torch.uint8)
        self._columnwise_data = torch.zeros(k, m // 2, dtype=torch.uint8)
        self._columnwise_scale_inv = torch.zeros(k, m // 16, dtype=torch.uint8)
        self._amax_rowwise = self._amax_columnwise = torch.ones(1)
        self._fp4_dtype = "DType.kFloat4E2M1"
