"""``MXFP8ReshardTransform``: land BF16 weights in persistent MXFP8 destinations, in one of two wire modes.

Claims: canonical names matching its ``(pattern, mode)`` rules (fnmatch; the first matching rule
gives the name's mode). Every rank of a refit must answer ``should_transform`` alike, so the
transform must be attached on SENDING ranks too: on a rank that holds a destination model made by
``make_mxfp8`` the plugin's ``reshard_transforms`` hook attaches one automatically (colocated
ranks need nothing more; do not pass a second one there, two transforms claiming a name is an
error); a rank that only sends passes ``refit(src, None, transform=MXFP8ReshardTransform(patterns,
mode=...))`` with the same patterns and mode as ``make_mxfp8``.

Modes (per op, decided by ``quantized_on_wire(mode, op)``, a pure function of the op, so both ends agree):

- ``"receiver"``: ``wire_dtype`` (BF16) on the wire. On landing, a slice whose K range in the
  destination's local tensor is made of whole 32-blocks is quantized at once into the persistent
  buffers (``quantize_into(..., offsets=op.dst_local)``; rowwise blocks are 1x32 so rows never need
  aligning). Other slices, and every slice of a swizzled (flashinfer) destination, are copied into a
  local BF16 accumulator; ``finalize_tensor`` quantizes the accumulated blocks once.
- ``"sender"``: where the slice is block-aligned, the sender quantizes it and ships uint8 data
  (slice shape) + uint8 valid scale rows ``[prod(sizes[:-1]), sizes[-1]/32]`` (~half of BF16's
  bytes); the receiver stores them as they are. Non-aligned ops fall back to BF16 (then as above).
  LOCAL ops take the same path inside the rank. A source extracted from a TE MXFP8 param
  (``te_extract``) ships slices of its own rowwise planes instead of requantizing (byte-exact).

The destination then holds ``quantize(local bf16 weight)``, value- and byte-exact in both modes.
``transient_bytes`` reports the accumulator: the local weight in ``wire_dtype`` for a swizzled
destination in receiver mode; for other destinations, only once a previous refit of the (cached,
identical) plan needed one for misaligned slices.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

import torch

from reshard_core import ReshardTransform, TransferOp

from .destinations import MODES, MXFP8Destination
from .format import quantize
from .layout import BLOCK
from .te_extract import te_wire_planes


def quantized_on_wire(mode: str, op: TransferOp) -> bool:
    """Whether ``op`` travels as MXFP8 data + scale: sender mode and a K range of whole 32-blocks in the
    destination's local tensor (``op.dst_local``/``op.sizes``). Pure function of the op."""
    if mode != "sender" or len(op.sizes) < 2 or op.dst_local is None or op.numel == 0:
        return False
    return op.dst_local[-1] % BLOCK == 0 and op.sizes[-1] % BLOCK == 0


def _aligned(op: TransferOp) -> bool:
    return len(op.sizes) >= 2 and op.dst_local[-1] % BLOCK == 0 and op.sizes[-1] % BLOCK == 0


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


class MXFP8ReshardTransform(ReshardTransform):
    """BF16 → MXFP8 while resharding into ``MXFP8Destination`` buffers (see the module docstring).

    ``patterns``: canonical-name fnmatch patterns (a string or several), all in ``mode``; or pass
    ``rules`` as ``(pattern, mode)`` pairs. ``destinations``: this rank's destinations by canonical
    name (None on a rank that only sends). ``wire_dtype``: the high-precision wire dtype.
    """

    def __init__(
        self,
        patterns: str | Iterable[str] = (),
        *,
        mode: str = "receiver",
        rules: Iterable[tuple[str, str]] = (),
        destinations: Mapping[str, MXFP8Destination] | None = None,
        wire_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
        self.rules = tuple(rules) + tuple((p, mode) for p in patterns)
        for _, m in self.rules:
            if m not in MODES:
                raise ValueError(f"unknown MXFP8 conversion mode {m!r}; expected one of {', '.join(MODES)}")
        self.destinations = dict(destinations or {})
        self.wire_dtype = wire_dtype
        self._acc: dict[str, torch.Tensor] = {}
        self._acc_boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self._needs_acc: set[str] = set()
        self._held: dict[str, int] = {}

    def mode_of(self, name: str) -> str | None:
        """The mode of the first rule matching ``name``, or None when no rule does."""
        for pattern, mode in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return mode
        return None

    def should_transform(self, name: str) -> bool:
        return self.mode_of(name) is not None

    # sender side -------------------------------------------------------------------------------
    def prepare_send(self, name: str, op: TransferOp, src_view: torch.Tensor) -> list[torch.Tensor]:
        if not quantized_on_wire(self.mode_of(name), op):
            return [src_view.to(self.wire_dtype)]
        planes = te_wire_planes(op, src_view)  # a TE MXFP8 source: its own bytes, byte-exact
        if planes is not None:
            return planes
        x = src_view.to(self.wire_dtype)
        data, scale = quantize(x.contiguous())
        rows = x.numel() // x.shape[-1]
        return [data, scale[:rows, : x.shape[-1] // BLOCK].contiguous()]

    # receiver side -----------------------------------------------------------------------------
    def prepare_recv(self, name: str, op: TransferOp) -> list[torch.Tensor]:
        device = self._dest(name).data.device
        if not quantized_on_wire(self.mode_of(name), op):
            return [torch.empty(op.sizes, dtype=self.wire_dtype, device=device)]
        rows = op.numel // op.sizes[-1]
        return [
            torch.empty(op.sizes, dtype=torch.uint8, device=device),
            torch.empty((rows, op.sizes[-1] // BLOCK), dtype=torch.uint8, device=device),
        ]

    def finalize_recv(self, name: str, op: TransferOp, buffers: Sequence[torch.Tensor]) -> None:
        dest = self._dest(name)
        if len(buffers) == 2:
            dest.write_quantized(op.dst_local, buffers[0], buffers[1])
        elif _aligned(op) and not dest.swizzled:
            dest.quantize_box(buffers[0], op.dst_local)
        else:
            acc = self._acc.get(name)
            if acc is None:
                acc = torch.empty(dest.local_shape, dtype=self.wire_dtype, device=dest.data.device)
                self._acc[name] = acc
            acc[_box(op.dst_local, op.sizes)].copy_(buffers[0])
            self._acc_boxes.setdefault(name, []).append((tuple(op.dst_local), tuple(op.sizes)))

    def finalize_tensor(self, name: str) -> None:
        acc = self._acc.pop(name, None)
        boxes = self._acc_boxes.pop(name, [])
        if acc is None:
            return
        self._needs_acc.add(name)
        dest = self._dest(name)
        if sum(torch.Size(s).numel() for _, s in boxes) == acc.numel():
            dest.quantize_full(acc)  # every element came through the accumulator
            return
        # Quantized-on-the-wire ops cover whole blocks, so the blocks around accumulated slices hold
        # only accumulated elements: round each slice out to whole K blocks and quantize it.
        k = dest.local_shape[-1]
        for offsets, sizes in boxes:
            k0 = offsets[-1] // BLOCK * BLOCK
            k1 = min(k, -(-(offsets[-1] + sizes[-1]) // BLOCK) * BLOCK)
            start, size = (*offsets[:-1], k0), (*sizes[:-1], k1 - k0)
            dest.quantize_box(acc[_box(start, size)], start)

    def transient_bytes(self, name: str) -> int:
        if name in self._held:  # the executor asks at the tensor's first op and after finalize_tensor
            return self._held.pop(name)
        dest = self.destinations.get(name)
        needs = dest is not None and (
            (dest.swizzled and self.mode_of(name) == "receiver") or name in self._needs_acc
        )
        held = dest.data.numel() * self.wire_dtype.itemsize if needs else 0
        self._held[name] = held
        return held

    def _dest(self, name: str) -> MXFP8Destination:
        dest = self.destinations.get(name)
        if dest is None:
            raise KeyError(
                f"MXFP8ReshardTransform has no destination buffers for {name!r} on this rank; "
                f"convert it with make_mxfp8 on the destination model"
            )
        return dest
