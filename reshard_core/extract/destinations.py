"""Destination tensors a refit cannot write correctly, found before any data moves.

Three mistakes write wrong data (or none) without any error at execution: a destination on the
``meta`` device (no storage: the refit "succeeds" having written nothing), an expanded tensor
(stride 0: many elements share one memory cell), and two destination tensors sharing memory
(one silently overwrites the other). ``destination_problems`` lists them for the verdict round, so
every rank raises the same error. Views of one parameter that touch disjoint elements (the q/k/v
rows of a fused projection, a ``SplitView`` of interleaved groups, the parts of a
``PiecewiseView``) are legitimate: overlap is
decided on the elements each tensor addresses, not on shared storage.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch

from ..specs import TensorSpec
from ..views import storage_views


def destination_problems(specs: Sequence[TensorSpec], rank: int, ignore: Sequence[str] = ()) -> list[str]:
    """One line per problem of this rank's destination tensors (tensors ``ignore`` matches are skipped)."""
    problems, strided = [], []
    for spec in specs:
        name, tensor = spec.meta.name, spec.tensor
        if any(fnmatch.fnmatchcase(name, p) for p in ignore):
            continue
        for base in storage_views(tensor):
            problem = _problem(name, base, rank)
            if problem:
                problems.append(problem)
                break
            if base.numel():
                strided.append((name, base))
    problems += _overlaps(strided, rank)
    return problems


def _problem(name: str, base: torch.Tensor, rank: int) -> str:
    """Why a destination's storage view cannot be written correctly ("" when it can)."""
    if base.device.type == "meta":
        return (
            f"destination tensor '{name}' on rank {rank} is on the meta device (it has no storage to "
            "write into); materialise the model first (e.g. to_empty() and initialise it)"
        )
    zero = [d for d, (n, s) in enumerate(zip(base.shape, base.stride(), strict=True)) if s == 0 and n > 1]
    if zero:
        return (
            f"destination tensor '{name}' on rank {rank} is expanded (stride 0 along dim {zero[0]}): "
            "many of its elements share one memory cell; give it its own storage (e.g. .clone())"
        )
    return ""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, stop)`` of ``t``'s elements within its storage."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    size = t.element_size()
    return t.storage_offset() * size, (t.storage_offset() + last + 1) * size


def _elements(t: torch.Tensor) -> torch.Tensor:
    """Byte offsets of ``t``'s elements within its storage (error-prone cases only: extents overlap)."""
    offsets = torch.full((), t.storage_offset(), dtype=torch.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[d] = n
        offsets = offsets + (torch.arange(n, dtype=torch.int64) * s).view(shape)
    return offsets.flatten() * t.element_size()


def _overlaps(tensors: list[tuple[str, torch.Tensor]], rank: int) -> list[str]:
    """Pairs of tensors addressing a common byte of one storage (first pair per tensor)."""
    by_storage: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, t in tensors:
        start, stop = _extent(t)
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((start, stop, name, t))
    found = []
    for items in by_storage.values():
        items.sort(key=lambda x: x[:2])
        for i, (_, stop, name, t) in enumerate(items):
            for start2, _, name2, t2 in items[i + 1 :]:
                if start2 >= stop:
                    break
                if name2 != name and _share_bytes(t, t2):  # one name twice is the format's error
                    found.append(
                        f"destination tensors '{name}' and '{name2}' on rank {rank} share memory (writing "
                        "one overwrites the other); give each its own storage"
                    )
                    break
    return found


def _share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage address a common byte (elements may differ in size)."""
    ea, eb = _elements(a), _elements(b)
    wa, wb = a.element_size(), b.element_size()
    if wa == wb:
        return bool(torch.isin(ea, eb).any())
    cells_a = (ea.unsqueeze(1) + torch.arange(wa)).flatten()
    cells_b = (eb.unsqueeze(1) + torch.arange(wb)).flatten()
    return bool(torch.isin(cells_a, cells_b).any())
