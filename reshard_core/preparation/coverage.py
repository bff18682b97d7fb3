"""Does a destination format write each element of the parameters it maps exactly once?

A format maps a destination parameter onto logical tensors by views, plus padding views. Planning
checks the logical side (every logical element written exactly once); this checks the physical
side: the views and padding cut out of one local parameter must add up to it, so a fused part the
format forgot is no silent garbage and two parts mapped onto the same rows are no silent double
write. It counts elements per parameter (each view lies within one parameter's storage span):
O(views), no per-element work. A count below the parameter's size means at least that many
elements are never written; above it, at least that many are written twice.

Parameters no view touches are the format's to report as ``unmapped``; specs whose data a transform
handles (``source`` set, or no local tensor) are not counted. Parameters are told apart by storage,
not name: virtual-pipeline chunks each have a ``decoder.layers.0`` of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..extract import iter_tensors, root_modules
from ..specs import TensorSpec
from ..views import storage_views

_Span = tuple[int, int, int]  # (storage data_ptr, first element, one past the last)


def coverage_problems(
    model: Any, specs: Sequence[TensorSpec], padding: Sequence[torch.Tensor], fmt: str
) -> list[str]:
    """Error lines (empty when fine) for destination ``specs`` and ``padding`` of ``model`` by ``fmt``."""
    params: dict[int, list[tuple[int, int, str, int]]] = {}
    roots = root_modules(model)
    for chunk, root in enumerate(roots):
        for name, tensor, _ in iter_tensors(root):
            local = getattr(tensor, "_local_tensor", tensor)
            span = _span(local)
            label = f"{name} (chunk {chunk})" if len(roots) > 1 else name
            if span is not None:
                params.setdefault(span[0], []).append((span[1], span[2], label, local.numel()))
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    stray: list[str] = []
    for label, view in [(s.meta.name, s.tensor) for s in specs if s.source is None] + [
        (None, p) for p in padding
    ]:
        parts = storage_views(view)
        if len(parts) == 1 and parts[0] is not view:  # a split view: its elements, over its base
            parts = [(parts[0], view.numel())]
        else:
            parts = [(p, p.numel()) for p in parts]
        for base, numel in parts:
            span = _span(base) if numel else None
            if span is None:
                continue
            owner = _owner(params.get(span[0], ()), span)
            if owner is None:
                if label is not None and label not in stray:
                    stray.append(label)
                continue
            counts[owner[2]] = counts.get(owner[2], 0) + numel
            sizes[owner[2]] = owner[3]
    short = [f"{n} ({sizes[n] - c} of {sizes[n]} elements)" for n, c in counts.items() if c < sizes[n]]
    over = [f"{n} ({c - sizes[n]} elements more than it holds)" for n, c in counts.items() if c > sizes[n]]
    out = []
    if short:
        out.append(
            f"format '{fmt}' leaves {_count(short)} partly unwritten: {', '.join(short)}; "
            "map those elements or return them as padding"
        )
    if over:
        out.append(f"format '{fmt}' maps parts of {_count(over)} more than once: {', '.join(over)}")
    if stray:
        out.append(
            f"format '{fmt}' gives {len(stray)} destination logical tensor{'s' if len(stray) > 1 else ''} "
            f"that {'are' if len(stray) > 1 else 'is'} no view of the model's tensors (writes would be "
            f"lost): {', '.join(stray)}"
        )
    return out


def _count(items: list[str]) -> str:
    return f"{len(items)} destination tensor{'s' if len(items) > 1 else ''}"


def _span(tensor: torch.Tensor) -> _Span | None:
    """Where ``tensor``'s elements lie in its storage; None when empty or without plain storage."""
    if tensor.numel() == 0:
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
        return None
    start = tensor.storage_offset()
    last = sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return ptr, start, start + last + 1


def _owner(candidates, span: _Span) -> tuple[int, int, str, int] | None:
    """The smallest parameter whose span holds ``span``."""
    inside = [c for c in candidates if c[0] <= span[1] and span[2] <= c[1]]
    return min(inside, key=lambda c: c[1] - c[0], default=None)
