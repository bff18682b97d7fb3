"""Walk a model's parameters and persistent buffers and ask the extractor hooks for their specs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..plugins import get_plugin_manager
from ..specs import TensorSpec
from .context import ExtractContext, ExtractError
from .unwrap import unwrap_all


def extract_specs(
    model: torch.nn.Module | list[torch.nn.Module] | None,
    side: str,
    *,
    group: Any = None,
    context: ExtractContext | None = None,
) -> list[TensorSpec]:
    """This rank's specs for every parameter and persistent buffer of ``model``.

    ``model`` may be None (this rank holds nothing on this side) or a list of modules (e.g.
    Megatron virtual-pipeline chunks). ``side`` is ``"src"`` or ``"dst"``. ``group`` is the group
    plain, undeclared tensors are replicated over (default: the world). Tensors shared under
    several names are reported once (first name). Raises ``ExtractError`` when no extractor claims
    a tensor, an extractor returns something other than specs, a spec's local tensor does not
    match its layout on this rank, or two tensors resolve to one canonical name.
    """
    if side not in ("src", "dst"):
        raise ExtractError(f"side must be 'src' or 'dst', got {side!r}")
    ctx = context or ExtractContext.create(group)
    hook = get_plugin_manager().hook.reshard_extract_tensor
    specs: list[TensorSpec] = []
    origin: dict[str, str] = {}
    for root in root_modules(model):
        for qualname, tensor, owner in iter_tensors(root):
            call = dict(qualname=qualname, tensor=tensor, owner=owner, model=root, side=side, context=ctx)
            try:
                found = hook(**call)
            except ExtractError:
                raise
            except Exception as exc:  # a plugin's bug: one error naming it, raised on every rank
                raise ExtractError(
                    f"the reshard_extract_tensor hook of plugin '{_plugin_of(exc, hook)}' raised on {side} "
                    f"tensor '{qualname}': {type(exc).__name__}: {exc}"
                ) from exc
            if found is None:
                raise ExtractError(
                    f"no extractor claimed {side} tensor '{qualname}' of type {type(tensor).__name__}; "
                    f"install a plugin for it or declare its layout with reshard_core.declare_layout"
                )
            if not isinstance(found, list) or not all(isinstance(s, TensorSpec) for s in found):
                raise ExtractError(
                    f"the reshard_extract_tensor hook of plugin '{_answering(hook, call)}' returned "
                    f"{type(found).__name__} for {side} tensor '{qualname}', not a list of TensorSpec"
                )
            for spec in _checked(found, qualname, ctx):
                if spec.meta.name in origin:
                    raise ExtractError(
                        f"tensors '{origin[spec.meta.name]}' and '{qualname}' both resolve to "
                        f"canonical name '{spec.meta.name}'"
                    )
                origin[spec.meta.name] = qualname
                specs.append(spec)
    return specs


def _plugin_of(exc: BaseException, hook: Any) -> str:
    """The name of the plugin whose hook implementation ``exc`` was raised in (innermost frame)."""
    owners = {impl.function.__code__: impl.plugin_name for impl in hook.get_hookimpls()}
    found, tb = "?", exc.__traceback__
    while tb is not None:
        found = owners.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def iter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.nn.Module]]:
    """``(qualname, tensor, owning module)`` for parameters, then persistent buffers, deduplicated."""
    seen: set[int] = set()
    modules = list(model.named_modules())
    for kind in ("_parameters", "_buffers"):
        for prefix, module in modules:
            skip = module._non_persistent_buffers_set if kind == "_buffers" else ()
            for leaf, tensor in getattr(module, kind).items():
                if tensor is None or leaf in skip or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                yield (f"{prefix}.{leaf}" if prefix else leaf), tensor, module


def root_modules(model: Any) -> list[torch.nn.Module]:
    """The root modules of ``model`` (a module, a list of pipeline chunks, or None), unwrapped
    (``unwrap``). Raises ``ExtractError`` for an item that is no ``torch.nn.Module``."""
    roots = unwrap_all(model)
    for m in roots:
        if not isinstance(m, torch.nn.Module):
            raise ExtractError(f"expected a torch.nn.Module, got {type(m).__name__}")
    return roots


def _answering(hook: Any, call: dict[str, Any]) -> str:
    """The plugin whose implementation answers ``call`` first (asked again, on the failure path)."""
    for impl in reversed(hook.get_hookimpls()):
        if impl.function(**{arg: call[arg] for arg in impl.argnames}) is not None:
            return impl.plugin_name
    return "?"


def _checked(found: list[TensorSpec], qualname: str, ctx: ExtractContext) -> list[TensorSpec]:
    for spec in found:
        expected = spec.layout.local_shape(spec.meta.shape, ctx.rank)
        if expected is None:
            raise ExtractError(
                f"tensor '{spec.meta.name}': rank {ctx.rank} is not in the mesh "
                f"{spec.layout.mesh.ranks} of its layout"
            )
        if spec.tensor is not None and tuple(spec.tensor.shape) != expected:
            raise ExtractError(
                f"tensor '{spec.meta.name}': local shape {tuple(spec.tensor.shape)} on rank {ctx.rank} "
                f"differs from {expected} given by its layout"
            )
    return found
