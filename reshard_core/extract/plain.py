"""Plain tensors: replicated by default, or laid out as declared with ``declare_layout``.

Inference engines often hold weights as plain tensors with neither DTensor placements nor Megatron
attributes. ``declare_layout`` stores a ``Layout`` on the tensor (attribute ``_reshard_layout``,
with an optional canonical-name override in ``_reshard_name``); the plain extractor reads it back.
An undeclared plain tensor is replicated over the extraction group (default: the world), so every
rank of that group must hold the identical full tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout, Mesh, Replicate, Shard
from ..specs import TensorMeta, TensorSpec
from .context import ExtractContext, ExtractError
from .unwrap import strip_wrappers

LAYOUT_ATTR = "_reshard_layout"
NAME_ATTR = "_reshard_name"
SHAPE_ATTR = "_reshard_shape"


def declare_layout(
    tensor: torch.Tensor,
    *,
    dim: int | None = None,
    stride: int = 1,
    components: Sequence[int] = (),
    sizes: Sequence[int] = (),
    group: Any = None,
    ranks: Sequence[int] | None = None,
    name: str | None = None,
    shape: Sequence[int] | None = None,
    layout: Layout | None = None,
) -> torch.Tensor:
    """Declare how the plain ``tensor`` (this rank's piece) is spread over ranks; return it.

    The mesh is ``ranks`` (global ranks in shard order), else the ranks of ``group``, else the
    world; this rank must be in it. ``dim=None`` means replicated over the mesh; otherwise the
    tensor is ``Shard(dim, stride, components)`` over it (``components``: full sizes of packed
    parts, see ``reshard_core.layout.Shard``), or ``Shard(dim, sizes=sizes)`` when ``sizes`` (each
    rank's extent, an uneven split) is given. ``shape`` is the global shape; by default it is the
    local shape with ``dim`` scaled by the mesh size (``sum(components)`` or ``sum(sizes)`` when
    given), which is right for even splits only. ``layout`` gives a complete ``Layout`` instead (then ``dim``,
    ``stride``, ``components``, ``group`` and ``ranks`` must be left out). ``name`` overrides the
    canonical name. Raises ``ExtractError`` when the local shape does not match the declaration.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ExtractError(f"declare_layout expects a tensor, got {type(tensor).__name__}")
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if layout is not None:
        if dim is not None or stride != 1 or components or sizes or group is not None or ranks is not None:
            raise ExtractError(
                "declare_layout: pass either layout= or dim/stride/components/sizes/group/ranks"
            )
    else:
        layout = _layout_from_args(tensor, dim, stride, tuple(components), tuple(sizes), group, ranks)
    local = tuple(tensor.shape)
    if shape is None:
        shape = _default_global_shape(local, layout)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(local):
        raise ExtractError(
            f"declare_layout: global shape {shape} has {len(shape)} dims, the tensor has {len(local)}"
        )
    _check_local_shape(name or "<declared tensor>", local, shape, layout, me)
    setattr(tensor, LAYOUT_ATTR, layout)
    setattr(tensor, SHAPE_ATTR, shape)
    setattr(tensor, NAME_ATTR, name)
    return tensor


def _layout_from_args(tensor, dim, stride, components, sizes, group, ranks) -> Layout:
    if ranks is not None and group is not None:
        raise ExtractError("declare_layout: pass group= or ranks=, not both")
    if ranks is not None:
        mesh_ranks = tuple(int(r) for r in ranks)
    elif group is not None:
        mesh_ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    else:
        initialised = dist.is_available() and dist.is_initialized()
        mesh_ranks = tuple(range(dist.get_world_size() if initialised else 1))
    if not mesh_ranks:
        raise ExtractError("declare_layout: the rank list is empty")
    try:
        mesh = Mesh.of(mesh_ranks)
        if dim is None:
            if stride != 1 or components or sizes:
                raise ExtractError("declare_layout: stride/components/sizes need dim=")
            return Layout(mesh, (Replicate(),))
        if not 0 <= dim < tensor.dim():
            raise ExtractError(f"declare_layout: dim={dim} is out of range for a {tensor.dim()}-d tensor")
        shard = Shard(dim, stride, tuple(int(c) for c in components), tuple(int(n) for n in sizes))
        return Layout(mesh, (shard,))
    except ValueError as exc:
        raise ExtractError(f"declare_layout: {exc}") from None


def _default_global_shape(local: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    shape = list(local)
    for size, placement in zip(layout.mesh.shape, layout.placements, strict=True):
        if isinstance(placement, Shard):
            if placement.components or placement.sizes:
                shape[placement.dim] = sum(placement.components or placement.sizes)
            else:
                shape[placement.dim] *= size
    return tuple(shape)


def _check_local_shape(name: str, local, shape, layout: Layout, rank: int) -> None:
    if layout.mesh.coord_of(rank) is None:
        raise ExtractError(f"tensor '{name}': rank {rank} is not in its declared mesh {layout.mesh.ranks}")
    try:
        expected = layout.local_shape(shape, rank)
    except ValueError as exc:
        raise ExtractError(f"tensor '{name}': {exc}") from None
    if expected != tuple(local):
        raise ExtractError(
            f"tensor '{name}': local shape {tuple(local)} on rank {rank} does not match the declared "
            f"layout {layout} of global shape {tuple(shape)}, which gives {expected}"
        )


def is_plain(tensor: torch.Tensor) -> bool:
    """True for ``torch.Tensor``/``nn.Parameter`` (and subclasses that do not override dispatch).

    Lazy (uninitialised) params and FSDP1 ``FlatParameter`` (a flat shard of many params) are not.
    """
    if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
        return False
    if type(tensor).__name__ == "FlatParameter":
        return False
    return getattr(type(tensor), "__torch_dispatch__", None) is torch._C._disabled_torch_dispatch_impl


def extract_plain(qualname: str, tensor: torch.Tensor, context: ExtractContext) -> list[TensorSpec] | None:
    """Spec of a plain tensor (declared, else replicated over the context's ranks); None otherwise."""
    if not is_plain(tensor):
        return None
    layout = getattr(tensor, LAYOUT_ATTR, None)
    name = getattr(tensor, NAME_ATTR, None) or strip_wrappers(qualname)
    if layout is None:
        ranks = context.default_ranks()
        if context.rank not in ranks:
            raise ExtractError(
                f"tensor '{name}': rank {context.rank} is not in the extraction group {ranks}"
            )
        meta = TensorMeta(name, tuple(tensor.shape), tensor.dtype)
        return [TensorSpec(meta, Layout.replicated(ranks), tensor)]
    shape = getattr(tensor, SHAPE_ATTR)
    _check_local_shape(name, tuple(tensor.shape), shape, layout, context.rank)
    return [TensorSpec(TensorMeta(name, tuple(shape), tensor.dtype), layout, tensor)]
