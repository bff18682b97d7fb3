"""Persistent MXFP8 destinations: chosen destination weights become MXFP8 buffers refits fill in place.

``make_mxfp8(model, patterns, form=..., mode=...)`` replaces each matching parameter of a destination
model by persistent buffers in one of three forms:

- ``"pair"``: uint8 E4M3 data in the weight's local shape + uint8 E8M0 scale in TE's padded 2-D rowwise
  layout ``[roundup(M,128), roundup(K/32,4)]`` (zero padding);
- ``"flashinfer"``: ``float8_e4m3fn`` data + the 1-D swizzled "128x4" scale FlashInfer/cuBLAS take;
- ``"te"``: a Transformer Engine ``MXFP8Tensor`` (rowwise); only when TE imports, else ``RuntimeError``.

Contract:

- Patterns (fnmatch) are matched against CANONICAL names (what ``reshard`` calls the tensor, e.g. global
  Megatron layer indices), so every rank passing the same patterns claims the same logical tensors and
  agrees on the wire format. A matching tensor that is not an MXFP8-quantizable rowwise weight (ndim ≥ 2,
  local last dim % 32 == 0) is a ``ValueError``.
- The weight's layout is captured from the original parameter (built-in DTensor / Megatron / plain
  extractor) before it is converted; the parameter is then removed and its module gets a persistent
  buffer of the same name holding the data tensor, whose attribute ``_reshard_mxfp8`` is the
  ``MXFP8Destination``. The plugin's extractor reports it as a spec with ``tensor=None`` and
  ``source=<the MXFP8Destination>``; its ``reshard_transforms`` hook attaches an ``MXFP8ReshardTransform``.
- Buffers are allocated once and only ever written in place (``data_ptr()`` stable across refits);
  scale padding stays zero.
- The local destination holds ``quantize(local bf16 weight)`` (rowwise, 1x32 blocks along K). When the
  local shard's K range starts on a multiple of 32 globally (any TP split into 32-multiples), that is
  exactly the matching slice of ``quantize(full weight)``.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .format import dequantize, quantize, quantize_into
from .layout import BLOCK, flat_rows, scale_shape, valid_scale_shape
from .swizzle import swizzle_128x4, unswizzle_128x4

FORMS = ("pair", "flashinfer", "te")
MODES = ("receiver", "sender")
MARKER = "_reshard_mxfp8"


@dataclass(eq=False)
class MXFP8Destination:
    """One rank's persistent MXFP8 buffers for one logical weight (rowwise blocks).

    ``data``: E4M3 bytes in ``local_shape`` (uint8 for pair/te, float8_e4m3fn for flashinfer).
    ``scale``: uint8 E8M0, 2-D padded (pair/te) or 1-D swizzled 128x4 (flashinfer).
    ``rules``: the ``(pattern, mode)`` pairs that claimed it (the transform claims names by them).
    """

    name: str
    meta: Any  # reshard_core.specs.TensorMeta of the original weight (global shape, original dtype)
    layout: Any  # reshard_core.layout.Layout of the original weight
    form: str
    data: torch.Tensor = field(repr=False)
    scale: torch.Tensor = field(repr=False)
    rules: tuple[tuple[str, str], ...] = ()
    te_tensor: Any = field(default=None, repr=False)
    _swizzle_index: torch.Tensor | None = field(default=None, repr=False)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def swizzled(self) -> bool:
        return self.scale.dim() == 1

    def _scale_rows(self) -> torch.Tensor:
        """Valid scale entries as ``[*local_shape[:-1], K/32]`` (indices into the 1-D layout if swizzled)."""
        rows, cols = valid_scale_shape(self.local_shape)
        lead = self.local_shape[:-1]
        if not self.swizzled:
            return self.scale[:rows, :cols].view(*lead, cols)
        if self._swizzle_index is None:
            r, c = scale_shape(self.local_shape)
            pos = swizzle_128x4(torch.arange(r * c, device=self.scale.device).view(r, c))
            inv = torch.empty_like(pos)
            inv[pos] = torch.arange(r * c, device=self.scale.device)
            self._swizzle_index = inv.view(r, c)
        return self._swizzle_index[:rows, :cols].view(*lead, cols)

    def write_quantized(self, offsets: Sequence[int], data: torch.Tensor, scale: torch.Tensor) -> None:
        """Store an already quantized block-aligned box: ``data`` (uint8, box shape) and ``scale`` (uint8,
        ``[prod(box[:-1]), box[-1]/32]``) at local ``offsets``."""
        sizes = tuple(data.shape)
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        self.data.view(torch.uint8)[box].copy_(data.view(torch.uint8))
        k0 = offsets[-1] // BLOCK
        where = box[:-1] + (slice(k0, k0 + sizes[-1] // BLOCK),)
        values = scale.reshape(*sizes[:-1], sizes[-1] // BLOCK)
        if self.swizzled:
            self.scale.view(-1)[self._scale_rows()[where].reshape(-1)] = values.reshape(-1)
        else:
            self._scale_rows()[where].copy_(values)

    def quantize_box(self, x: torch.Tensor, offsets: Sequence[int]) -> None:
        """Quantize the block-aligned box ``x`` of the local weight at local ``offsets`` into the buffers."""
        if not self.swizzled:
            quantize_into(x, self.data, self.scale, offsets=offsets)
            return
        data, scale = quantize(x.contiguous())
        self.write_quantized(offsets, data, scale[: flat_rows(x.shape), : x.shape[-1] // BLOCK])

    def quantize_full(self, x: torch.Tensor) -> None:
        """Quantize the whole local weight ``x`` into the buffers (scale padding zeroed)."""
        if not self.swizzled:
            quantize_into(x, self.data, self.scale)
            return
        data, scale = quantize(x)
        self.data.view(torch.uint8).copy_(data)
        self.scale.copy_(swizzle_128x4(scale))

    def values(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The local weight the buffers hold, dequantized (TE's rule)."""
        scale = self.scale
        if self.swizzled:
            r, c = scale_shape(self.local_shape)
            scale = unswizzle_128x4(scale, r, c)
        return dequantize(self.data, scale, dtype=dtype)


@functools.cache
def te_unavailable_reason() -> str | None:
    """None when Transformer Engine's ``MXFP8Quantizer`` imports, else why not."""
    try:
        import transformer_engine_torch  # noqa: F401
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer  # noqa: F401
    except Exception as exc:  # missing, or present but broken (no CUDA, ABI mismatch)
        return f"transformer_engine is not importable ({type(exc).__name__}: {exc})"
    return None


def make_mxfp8(
    model: torch.nn.Module,
    patterns: str | Iterable[str],
    *,
    form: str = "pair",
    mode: str = "receiver",
    group: Any = None,
) -> dict[str, MXFP8Destination]:
    """Convert the weights of destination ``model`` whose canonical names match ``patterns`` into
    persistent MXFP8 buffers (see the module docstring); return them by canonical name.

    ``form``: ``"pair"``, ``"flashinfer"`` or ``"te"``. ``mode``: ``"receiver"`` (BF16 on the wire,
    quantized on landing) or ``"sender"`` (data + scale on the wire where the slice is block-aligned);
    ranks that only send must pass ``MXFP8ReshardTransform(patterns, mode=mode)`` to ``refit``.
    ``group``: the process group plain, undeclared tensors are replicated over (default: the world).
    Buffers start as the quantization of the current weight values.
    """
    if form not in FORMS:
        raise ValueError(f"unknown MXFP8 destination form {form!r}; expected one of {', '.join(FORMS)}")
    if mode not in MODES:
        raise ValueError(f"unknown MXFP8 conversion mode {mode!r}; expected one of {', '.join(MODES)}")
    if form == "te" and (reason := te_unavailable_reason()) is not None:
        raise RuntimeError(f"MXFP8 destination form 'te' needs Transformer Engine: {reason}")
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    rules = tuple((p, mode) for p in patterns)
    from reshard_core.extract import ExtractContext, builtin_extract, iter_tensors

    context = ExtractContext.create(group)
    made: dict[str, MXFP8Destination] = {}
    for qualname, tensor, owner in list(iter_tensors(model)):
        if getattr(tensor, MARKER, None) is not None:
            continue
        specs = builtin_extract(
            qualname=qualname, tensor=tensor, owner=owner, model=model, side="dst", context=context
        )
        if not specs or len(specs) != 1:
            continue
        if not any(fnmatch.fnmatchcase(specs[0].meta.name, p) for p in patterns):
            continue
        spec = specs[0]
        local = spec.tensor.detach()
        _check_quantizable(spec.meta.name, local)
        dest = _allocate(spec, local, form, rules)
        dest.quantize_full(local)
        _replace(owner, qualname.rsplit(".", 1)[-1], dest)
        made[spec.meta.name] = dest
    return made


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def destinations_of(model: torch.nn.Module) -> dict[str, MXFP8Destination]:
    """The MXFP8 destinations ``make_mxfp8`` installed in ``model``, by canonical name."""
    from reshard_core.extract import iter_tensors

    found = {}
    for _, tensor, _ in iter_tensors(model):
        dest = getattr(tensor, MARKER, None)
        if dest is not None:
            found[dest.name] = dest
    return found


def _check_quantizable(name: str, local: torch.Tensor) -> None:
    if local.dim() < 2 or local.shape[-1] % BLOCK:
        raise ValueError(
            f"tensor {name!r} cannot become an MXFP8 destination: its local shape {tuple(local.shape)} "
            f"needs ndim >= 2 and a last dim divisible by {BLOCK}"
        )
    if local.dtype not in _FLOATS:
        raise ValueError(f"tensor {name!r} cannot become an MXFP8 destination: dtype {local.dtype}")


def _allocate(spec, local: torch.Tensor, form: str, rules) -> MXFP8Destination:
    shape, device = tuple(local.shape), local.device
    te_tensor = None
    if form == "te":
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        quantizer = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
        te_tensor = quantizer.make_empty(shape, dtype=spec.meta.dtype, device=device)
        data, scale = te_tensor._rowwise_data, te_tensor._rowwise_scale_inv
        scale.zero_()
    elif form == "flashinfer":
        data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        r, c = scale_shape(shape)
        scale = torch.zeros(r * c, dtype=torch.uint8, device=device)
    else:
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        scale = torch.zeros(scale_shape(shape), dtype=torch.uint8, device=device)
    return MXFP8Destination(spec.meta.name, spec.meta, spec.layout, form, data, scale, rules, te_tensor)


def _replace(owner: torch.nn.Module, leaf: str, dest: MXFP8Destination) -> None:
    """Swap ``owner.<leaf>`` (a parameter or buffer) for a persistent buffer holding ``dest.data``."""
    marker = dest.data
    setattr(marker, MARKER, dest)
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    owner.register_buffer(leaf, marker, persistent=True)
