"""The cut language: an engine's parameters described as views of logical tensors.

An inference engine (vLLM, SGLang, a hand-written one) holds on each rank fused, padded, sharded
parameters that carry no sharding metadata. An engine format therefore derives everything from the
model's config and the engine's parallel arrangement, into an ``EngineTable`` for one rank:

- every logical (HF checkpoint) tensor: its name, global shape and layout over ranks, and the
  parameter of which a *cut* is this rank's piece (none where the rank holds nothing of it);
- every parameter the rank must hold, with its local shape, checked before any data moves;
- the padding: cuts of parameters that no logical element maps to (a destination zero-fills them
  once, a source never reads them).

A cut is a tuple of views taken in order: ``Select(dim, index)`` (one index of a stacked dim,
dropped: an expert of ``w13_weight [E, 2I, H]``), ``Narrow(dim, start, size)`` (a stretch: the
``q`` rows of a fused ``qkv_proj``) and ``Every(dim, start, step)`` (every ``step``-th index from
``start``: GPT-OSS's gate rows, interleaved with its up rows). ``()`` is the whole parameter.

Building: ``layout`` (one object per distinct layout, which the exchange interns), ``param``,
``piece``, ``whole``, ``unpadded``, ``divided``. Using: ``specs`` lists the logical specs without
tensors (offline planning), ``resolve`` checks a rank's parameters against the table and returns
its views as ``FormatSpecs``. ``formats/vllm.py`` is an engine format written this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError
from ..layout import Layout, Mesh, Placement
from ..specs import TensorMeta, TensorSpec
from .base import FormatSpecs
from .pieces import unpad


@dataclass(frozen=True)
class Narrow:
    """``size`` indices of dim ``dim`` from ``start``."""

    dim: int
    start: int
    size: int

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.size)


@dataclass(frozen=True)
class Every:
    """Every ``step``-th index of dim ``dim`` from ``start`` (a strided view)."""

    dim: int
    start: int
    step: int

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        index = [slice(None)] * tensor.dim()
        index[self.dim] = slice(self.start, None, self.step)
        return tensor[tuple(index)]


@dataclass(frozen=True)
class Select:
    """Index ``index`` of dim ``dim``, which is dropped."""

    dim: int
    index: int

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.select(self.dim, self.index)


Cut = tuple[Narrow | Select | Every, ...]
"""Views taken in order of a local parameter; ``()`` is the whole of it."""


def apply_cut(tensor: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The view ``cut`` of ``tensor`` (of a parameter's data, so writes land in the parameter)."""
    out = tensor.detach() if isinstance(tensor, torch.nn.Parameter) else tensor
    for view in cut:
        out = view(out)
    return out


@dataclass(frozen=True)
class Piece:
    """One logical tensor: its name, global shape and layout, and where this rank holds it."""

    name: str
    shape: tuple[int, ...]
    layout: Layout
    param: str
    cut: Cut | None  # None: this rank holds none of it (or no rank was given)
    dtype: torch.dtype | None = None
    """The dtype the engine keeps it in whatever the model's (a router's fp32 bias); None: the model's."""


class EngineTable:
    """The logical tensors and parameters of an engine format on ``rank`` (None: no rank, for
    offline planning; every piece then has no cut and no parameter is expected).

    ``fmt`` names the format in errors; ``derived_from`` says what the table was derived from
    ("the config and parallel description"), in the error naming parameters that do not fit it.
    """

    def __init__(self, fmt: str, rank: int | None, derived_from: str) -> None:
        self.fmt, self.rank, self.derived_from = fmt, rank, derived_from
        self.pieces: list[Piece] = []
        self.padding: list[tuple[str, Cut]] = []
        self.params: dict[str, tuple[int, ...]] = {}
        """The parameters this rank must hold and their local shapes (empty without a rank)."""
        self._layouts: dict[tuple, Layout] = {}

    # ------------------------------------------------------------------ building

    def layout(self, ranks: tuple[int, ...], mesh_shape: tuple[int, ...], *placements: Placement) -> Layout:
        """The layout over a mesh of ``ranks``; equal layouts are one object."""
        key = (ranks, mesh_shape, placements)
        if key not in self._layouts:
            self._layouts[key] = Layout(Mesh(ranks, mesh_shape), placements)
        return self._layouts[key]

    def holds(self, layout: Layout) -> bool:
        """Whether this rank is in ``layout``'s mesh."""
        return self.rank is not None and layout.mesh.coord_of(self.rank) is not None

    def param(self, name: str, local_shape: tuple[int, ...]) -> None:
        """This rank holds parameter ``name`` with ``local_shape``."""
        if self.rank is not None:
            self.params[name] = local_shape

    def piece(
        self,
        name: str,
        shape: tuple[int, ...],
        layout: Layout,
        param: str,
        cut: Cut = (),
        dtype: torch.dtype | None = None,
    ) -> None:
        """Logical tensor ``name`` (global ``shape``, ``layout``): on a rank holding part of it,
        that part is ``cut`` of ``param``. ``dtype``: the engine keeps it in this dtype whatever
        the model's (offline specs only; a live piece has its tensor's)."""
        self.pieces.append(Piece(name, shape, layout, param, cut if self.holds(layout) else None, dtype))

    def whole(
        self,
        name: str,
        shape: tuple[int, ...],
        layout: Layout,
        param: str = "",
        dtype: torch.dtype | None = None,
    ) -> None:
        """A parameter (``param``, default ``name``) that is the logical tensor ``name``, whole on every
        rank of ``layout``."""
        param = param or name
        if self.holds(layout):
            self.param(param, shape)
        self.piece(name, shape, layout, param, (), dtype)

    def unpadded(
        self, name: str, padded: tuple[int, ...], layout: Layout, dim: int, size: int, param: str = ""
    ) -> None:
        """Parameter ``param`` (default ``name``) is a tensor of global shape ``padded`` laid out as
        ``layout`` whose first ``size`` indices along ``dim`` are the logical tensor ``name``; the
        rest is padding. The parameter itself is declared with ``param``."""
        param = param or name
        physical = TensorSpec(TensorMeta(name, padded, torch.float32), layout, None)
        logical = unpad(physical, dim, size, name, -1)[0]
        shape = logical.meta.shape
        keep = 0
        if self.holds(layout):
            keep = logical.layout.local_shape(shape, self.rank)[dim]
            held = layout.local_shape(padded, self.rank)[dim]
            if keep < held:
                self.padding.append((param, (Narrow(dim, keep, held - keep),)))
        self.piece(name, shape, logical.layout, param, (Narrow(dim, 0, keep),))

    def pad(self, param: str, cut: Cut = ()) -> None:
        """``cut`` of parameter ``param`` is padding on this rank (zero-filled, never sent)."""
        if self.rank is not None:
            self.padding.append((param, cut))

    def divided(self, what: str, n: int, by: int, by_what: str = "the TP size") -> int:
        """``n // by``; ``FormatError`` naming both when ``by`` does not divide ``n``."""
        if n % by:
            raise FormatError(f"format '{self.fmt}': {what} ({n}) is not divisible by {by_what} ({by})")
        return n // by

    # ------------------------------------------------------------------ using

    def specs(self, dtype: torch.dtype) -> list[TensorSpec]:
        """The logical specs, without tensors: every one without a rank, else those it holds."""
        return [
            TensorSpec(TensorMeta(p.name, p.shape, p.dtype or dtype), p.layout, None)
            for p in self.pieces
            if self.rank is None or p.cut is not None
        ]

    def resolve(self, params: dict[str, tuple[str, torch.Tensor]]) -> FormatSpecs:
        """This rank's logical specs as views of ``params`` (table name → ``(qualname, tensor)``),
        and its padding views; parameters the table does not know are ``unmapped`` (qualnames).

        Raises ``FormatError`` naming every parameter the table expects that is missing or has
        another local shape.
        """
        self._check(params)
        out = FormatSpecs(unmapped=[q for n, (q, _) in params.items() if n not in self.params])
        for piece in self.pieces:
            if piece.cut is not None:
                tensor = apply_cut(params[piece.param][1], piece.cut)
                meta = TensorMeta(piece.name, piece.shape, tensor.dtype)
                out.specs.append(TensorSpec(meta, piece.layout, tensor))
        out.padding = [apply_cut(params[name][1], cut) for name, cut in self.padding]
        return out

    def _check(self, params: dict[str, tuple[str, torch.Tensor]]) -> None:
        missing = [n for n in self.params if n not in params]
        wrong = [
            f"{n} {tuple(params[n][1].shape)}, expected {shape}"
            for n, shape in self.params.items()
            if n in params and tuple(params[n][1].shape) != shape
        ]
        problems = []
        if missing:
            problems.append(f"{_count(missing, 'parameter')} missing: {', '.join(missing)}")
        if wrong:
            problems.append(f"{_count(wrong, 'parameter')} with another local shape: {'; '.join(wrong)}")
        if problems:
            raise FormatError(
                f"format '{self.fmt}' on rank {self.rank}: {self.derived_from} imply "
                + " and ".join(problems)
            )


def _count(items: list, word: str) -> str:
    return f"{len(items)} {word}{'s' if len(items) != 1 else ''}"
