"""Transformer Engine quantized params held by FSDP2 (fsdp2-te.md C.3/C.4), duck-typed, TE never imported.

Between steps an FSDP2 param is a ``DTensor`` (``(Shard(0),)``, HSDP ``(Replicate(), Shard(0))``) whose
``_local_tensor`` is a TE ``MXFP8Tensor`` (``_rowwise_data``/``_rowwise_scale_inv`` and/or
``_columnwise_data``/``_columnwise_scale_inv``, uint8; scales padded or not, only the valid region
``[:rows, :K/32]`` / ``[:rows/32, :K]`` is read) or ``Float8Tensor`` (``_data`` + per-tensor ``_scale_inv``).
When TE could not keep a shard quantized (uneven dim 0, rows % 32 != 0) the local tensor is a plain
high-precision tensor: ``extract_te_param`` returns None and the built-in DTensor extractor takes it.

Wire modes:

- default, dequantize: the spec's tensor is a persistent buffer (nominal dtype, local shape) and its
  ``source`` a ``TESource`` whose ``refresh_source()`` (called by ``refit`` before every execution)
  dequantizes the live planes into it in place: value-exact (mxfp8.md A.3);
- byte-exact: when an op travels quantized (an MXFP8 destination made with ``mode="sender"``),
  ``MXFP8ReshardTransform.prepare_send`` asks ``te_wire_planes`` for the op's slice of
  ``_rowwise_data`` and of the valid scale rows, straight from the param (no requantization): the
  destination's bytes equal the source planes, ~1.03 bytes/element on the wire instead of 2.

A missing rowwise plane is an error unless ``configure_te_extraction(allow_columnwise=True)`` (or env
``RESHARD_TE_ALLOW_COLUMNWISE=1``): values then come from the columnwise plane (numerically different
from rowwise, mxfp8.md A.4) and quantized wires requantize them. Swizzled scales are unswizzled.
"""

from __future__ import annotations

import os
import weakref

import torch

from .format import dequantize
from .layout import BLOCK
from .swizzle import unswizzle_128x4

_OPTIONS = {
    "allow_columnwise": os.environ.get("RESHARD_TE_ALLOW_COLUMNWISE", "") not in ("", "0"),
    "ship_planes": True,
}
_REGISTRY: dict[int, weakref.ref] = {}  # storage pointer of a TESource buffer -> the TESource


def configure_te_extraction(*, allow_columnwise: bool | None = None, ship_planes: bool | None = None) -> dict:
    """Set process-wide TE extraction options; returns the previous ones (pass them back to restore).

    ``allow_columnwise``: accept values dequantized from the columnwise plane when a param has no
    rowwise plane (default False: error). ``ship_planes``: slice TE rowwise planes for quantized wires
    (byte-exact, default True); False requantizes the dequantized buffer instead (value-exact).
    """
    previous = dict(_OPTIONS)
    if allow_columnwise is not None:
        _OPTIONS["allow_columnwise"] = bool(allow_columnwise)
    if ship_planes is not None:
        _OPTIONS["ship_planes"] = bool(ship_planes)
    return previous


_MXFP8_CLASSES = frozenset({"MXFP8Tensor", "MXFP8TensorBase", "MXFP8TensorStorage"})
_FLOAT8_CLASSES = frozenset({"Float8Tensor", "Float8TensorBase", "Float8TensorStorage"})
# fields only TE's other quantized tensors carry: Float8BlockwiseQTensor (``_is_2D_scaled``) and NVFP4Tensor
# (``_fp4_dtype``, ``_amax_rowwise``/``_amax_columnwise``); they also hold ``_rowwise_scale_inv`` planes
_OTHER_TE_FIELDS = ("_is_2D_scaled", "_fp4_dtype", "_amax_rowwise", "_amax_columnwise")


def te_kind(local, name: str = "?") -> str | None:
    """``"mxfp8"``, ``"float8"`` or None for a tensor that does not look like a TE quantized tensor.

    TE's class names decide first (``MXFP8Tensor``/``Float8Tensor`` and their storage bases); other
    classes are duck-typed by their fields. Any other TE quantized tensor (blockwise FP8, NVFP4, or any
    class from ``transformer_engine`` with planes) raises ``ExtractError`` naming ``name`` and its type:
    their planes look like MXFP8's but hold other scales, so reading them as MXFP8 would be silently wrong.
    """
    try:
        mro = type(local).__mro__
        classes = {c.__name__ for c in mro}
        if classes & _MXFP8_CLASSES:
            return "mxfp8"
        if classes & _FLOAT8_CLASSES:
            return "float8"
        planes = hasattr(local, "_rowwise_scale_inv") or hasattr(local, "_scale_inv")
        from_te = any(c.__module__.startswith("transformer_engine") for c in mro)
        other = any(hasattr(local, f) for f in _OTHER_TE_FIELDS)
    except Exception:  # exotic wrappers may raise from attribute access
        return None
    if other or (from_te and planes):
        raise _error(
            f"tensor '{name}': TE quantized tensor of type {type(local).__name__} is not supported; "
            f"reshard reads TE MXFP8Tensor and Float8Tensor params only (blockwise FP8 and NVFP4 scales "
            f"are not MXFP8)"
        )
    if hasattr(local, "_rowwise_scale_inv") and hasattr(local, "_columnwise_scale_inv"):
        return "mxfp8"
    if hasattr(local, "_data") and hasattr(local, "_scale_inv"):
        return "float8"
    return None


def _error(message: str):
    from reshard_core import ExtractError

    return ExtractError(message)


def _fp8_torch_dtype(fp8_dtype) -> torch.dtype:
    """torch float8 dtype of a TE ``DType`` (or torch dtype / string) naming E4M3 or E5M2."""
    return torch.float8_e5m2 if "e5m2" in str(fp8_dtype).lower() else torch.float8_e4m3fn


def _valid_scale(scale: torch.Tensor, rows: int, cols: int, swizzled: bool, transposed: bool) -> torch.Tensor:
    """The valid ``[rows, cols]`` uint8 region of a (padded, maybe swizzled) scale plane."""
    scale = scale.view(torch.uint8)
    if not swizzled:
        return scale[:rows, :cols]
    if transposed:  # columnwise swizzles the transpose (mxfp8.md A.5)
        return unswizzle_128x4(scale.reshape(-1), cols, rows).t()
    return unswizzle_128x4(scale.reshape(-1), rows, cols)


class TESource:
    """One TE quantized param's local shard: a persistent dequantized buffer and the live planes.

    ``param`` is the DTensor param (its ``_local_tensor`` is re-read at every use, so a param whose
    local tensor is replaced between steps is still followed); ``buffer`` the spec tensor.
    """

    def __init__(self, name: str, param, kind: str, buffer: torch.Tensor) -> None:
        self.name, self.param, self.kind, self.buffer = name, param, kind, buffer
        _REGISTRY[buffer.untyped_storage().data_ptr()] = weakref.ref(self)

    @property
    def local(self):
        return getattr(self.param, "_local_tensor", self.param)

    def refresh_source(self) -> None:
        """Dequantize the live local planes into ``buffer`` in place."""
        self.buffer.copy_(self.dequantized())

    def dequantized(self) -> torch.Tensor:
        """The local shard's values in the buffer's dtype (value-exact with TE's dequantize)."""
        local, dtype = self.local, self.buffer.dtype
        if self.kind == "float8":
            data = getattr(local, "_data", None)
            if data is None:
                raise _error(f"tensor '{self.name}': TE Float8Tensor param has no _data plane")
            fp8 = data.view(_fp8_torch_dtype(getattr(local, "_fp8_dtype", None))).float()
            return (fp8 * local._scale_inv.float().reshape(-1)[0]).to(dtype)
        self._check_e4m3(local)
        planes = self.rowwise_planes()
        if planes is not None:
            return dequantize(planes[0], planes[1], dtype=dtype)
        data, scale = self._columnwise_planes()
        return dequantize(data, scale, columnwise=True, dtype=dtype)

    def rowwise_planes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(_rowwise_data [rows, K], valid scale [rows, K/32])`` uint8, or None without a rowwise plane."""
        local = self.local
        data = getattr(local, "_rowwise_data", None)
        scale = getattr(local, "_rowwise_scale_inv", None)
        if data is None or scale is None:
            if not _OPTIONS["allow_columnwise"]:
                raise _error(
                    f"tensor '{self.name}': TE MXFP8 param has no rowwise plane (only columnwise); rowwise "
                    f"values cannot be rebuilt exactly from it. Call "
                    f"reshard_mxfp8.configure_te_extraction(allow_columnwise=True) to accept "
                    f"columnwise-derived values"
                )
            return None
        data = data.view(torch.uint8)
        rows, k = data.numel() // data.shape[-1], data.shape[-1]
        swizzled = bool(getattr(local, "_with_gemm_swizzled_scales", False))
        return data, _valid_scale(scale, rows, k // BLOCK, swizzled, transposed=False)

    def _columnwise_planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.local
        data = getattr(local, "_columnwise_data", None)
        scale = getattr(local, "_columnwise_scale_inv", None)
        if data is None or scale is None:
            raise _error(f"tensor '{self.name}': TE MXFP8 param has neither a rowwise nor a columnwise plane")
        data = data.view(torch.uint8)
        rows, k = data.numel() // data.shape[-1], data.shape[-1]
        swizzled = bool(getattr(local, "_with_gemm_swizzled_scales", False))
        return data, _valid_scale(scale, rows // BLOCK, k, swizzled, transposed=True)

    def _check_e4m3(self, local) -> None:
        fp8 = getattr(local, "_fp8_dtype", None)
        if fp8 is not None and _fp8_torch_dtype(fp8) != torch.float8_e4m3fn:
            raise _error(f"tensor '{self.name}': TE MXFP8 param with element type {fp8} (E4M3 only)")


def extract_te_param(qualname: str, tensor, context) -> list | None:
    """Spec of a DTensor param whose local tensor is a TE MXFP8/Float8 tensor; None for anything else."""
    from reshard_core import TensorMeta, TensorSpec
    from reshard_core.extract import dtensor_shape_and_layout, is_dtensor, strip_wrappers

    if not is_dtensor(tensor):
        return None
    local = tensor._local_tensor
    name = strip_wrappers(qualname)
    kind = te_kind(local, name)
    if kind is None:
        return None  # includes TE's uneven fallback: a plain high-precision shard
    shape, layout = dtensor_shape_and_layout(name, tensor)  # the spec's shape and shard order
    expected = layout.local_shape(shape, context.rank)
    if expected is None or tuple(local.shape) != expected:
        raise _error(
            f"tensor '{name}': TE quantized local shape {tuple(local.shape)} on rank {context.rank} differs "
            f"from {expected} derived from layout {layout} of global shape {shape}"
        )
    buffer = torch.empty(expected, dtype=tensor.dtype, device=_plane_device(local, kind))
    source = TESource(name, tensor, kind, buffer)
    with torch.no_grad():
        source.refresh_source()  # fails early on a missing plane; refit refreshes again before each run
    return [TensorSpec(TensorMeta(name, shape, tensor.dtype), layout, buffer, source=source)]


def _plane_device(local, kind: str) -> torch.device:
    names = ("_data",) if kind == "float8" else ("_rowwise_data", "_columnwise_data")
    for n in names:
        t = getattr(local, n, None)
        if t is not None:
            return t.device
    return local.device


def te_source_of(view: torch.Tensor) -> TESource | None:
    """The ``TESource`` whose buffer ``view`` is a view of, or None."""
    ref = _REGISTRY.get(view.untyped_storage().data_ptr())
    source = ref() if ref is not None else None
    if source is None or source.buffer.untyped_storage().data_ptr() != view.untyped_storage().data_ptr():
        return None
    return source


def te_wire_planes(op, src_view: torch.Tensor) -> list[torch.Tensor] | None:
    """``[data, valid scale rows]`` of ``op``'s slice cut from the TE rowwise planes behind ``src_view``,
    or None (not a TE source, Float8, no rowwise plane, planes disabled, or a slice not made of whole
    local 32-blocks along K): the caller then quantizes ``src_view`` (value-exact)."""
    source = te_source_of(src_view)
    if source is None or source.kind != "mxfp8" or not _OPTIONS["ship_planes"] or len(op.sizes) != 2:
        return None
    (r0, k0), (n, kk) = op.src_local, op.sizes
    if k0 % BLOCK or kk % BLOCK:
        return None
    planes = source.rowwise_planes()
    if planes is None:
        return None
    data, scale = planes
    return [
        data[r0 : r0 + n, k0 : k0 + kk].contiguous(),
        scale[r0 : r0 + n, k0 // BLOCK : (k0 + kk) // BLOCK].contiguous(),
    ]
