"""Short, stable text for error messages: rank lists, tensor metas and regions."""

from __future__ import annotations

from collections.abc import Iterable

from ..specs import TensorMeta

_MAX_RUNS = 8


def format_ranks(ranks: Iterable[int], keep_order: bool = False) -> str:
    """``[0, 1, 2, 5]`` -> ``"[0-2, 5]"``; long lists are cut after a few runs with a total count.
    ``keep_order``: list the ranks in the given order (``[4-7, 0-3]``) instead of sorted."""
    ordered = list(ranks) if keep_order else sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    for r in ordered:
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = [f"{a}" if a == b else (f"{a}, {b}" if b == a + 1 else f"{a}-{b}") for a, b in runs[:_MAX_RUNS]]
    if len(runs) > _MAX_RUNS:
        text.append(f"… ({len(ordered)} ranks)")
    return "[" + ", ".join(text) + "]"


def format_meta(meta: TensorMeta) -> str:
    """``shape (4, 8) torch.bfloat16`` style."""
    return f"shape {tuple(meta.shape)} {str(meta.dtype).removeprefix('torch.')}"


def dim_word(dim: int) -> str:
    """What an index range along ``dim`` is called in messages."""
    return {0: "rows", 1: "columns"}.get(dim, f"dim {dim} indices")


def format_region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    """A box as ``[0:4, 8:16]`` (half-open per dim)."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes, strict=True)) + "]"


def format_layout(layout) -> str:
    """A layout without listing every rank: ``mesh (2, 4) on ranks [0-7] (Shard(0), Replicate())``."""
    placements = ", ".join(repr(p) for p in layout.placements)
    where = format_ranks(layout.mesh.ranks, keep_order=True)  # the order says who holds which piece
    return f"mesh {tuple(layout.mesh.shape)} on ranks {where} ({placements})"
