"""Logical tensors and the specs extractors produce for them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import Layout


@dataclass(frozen=True)
class TensorMeta:
    """One model weight as if unsharded: layout-independent canonical name, global shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class TensorSpec:
    """What one rank holds of one logical tensor on one side.

    ``layout`` describes every rank of its mesh, not only this one. ``tensor`` is the local tensor
    (or view) that realises this rank's holding; its shape equals ``layout.local_shape(meta.shape,
    rank)``. ``source`` is an optional object a format plugin attaches (e.g. a quantized param) that
    a transform knows how to read or fill.
    """

    meta: TensorMeta
    layout: Layout
    tensor: torch.Tensor | None
    source: Any = field(default=None, compare=False)
