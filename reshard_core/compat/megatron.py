"""Megatron-Core's refit surface (``megatron.core.resharding.refit``), run by reshard.

Swap one import and keep the calls::

    # from megatron.core.resharding.refit import swap_model_weights, clear_all_caches
    from reshard_core.compat.megatron import swap_model_weights, clear_all_caches

    swap_model_weights([train_model], [inference_model], "gloo")

Contract, per function (Megatron's names and argument order; extensions are keyword arguments at
the end and the return value, which Megatron leaves None):

- Models are a module, a ``[module]`` list as Megatron's training loop passes them (a list of
  virtual-pipeline chunks is refit chunk by chunk, where Megatron reads only ``[0]``), or None on a
  rank that only sends, only receives or idles. DDP / ``Float16Module`` / FSDP wrappers are
  unwrapped (``reshard_core.extract.unwrap``).
  A model without ``pg_collection`` raises Megatron's ``RuntimeError``; a missing ``dp`` group is
  filled from ``parallel_state`` as Megatron does.
- ``refit_method``: a backend name (``"gloo"``, ``"nccl"``, ``"nvshmem"``: reshard's transports of
  that name), a reshard ``CopyService``, or a Megatron ``CopyService`` instance (any object with
  ``submit_send``/``submit_recv``/``run``), which then moves every message reshard packs.
- ``group``: the process group the refit is collective over (default: the world).
- ``src_rank_offset`` / ``dst_rank_offset``: Megatron's offsets for models whose groups live in
  separate ``torch.distributed`` worlds. reshard plans in one world whose groups already hold
  global ranks, so only 0 is accepted (anything else is a ``ValueError`` saying so).
- ``transform``: a reshard ``ReshardTransform`` (or None).
- A destination whose config asks for inference-optimized MXFP8 is refused with ``ReshardError``
  before any data moves: Megatron's linears cannot run on reshard's MXFP8 buffers (``megatron_mxfp8``).
- After the weights landed, every destination module defining ``post_refit()`` (or, failing that,
  ``refresh_cache()``, its later name in Megatron) has it called once, in ``modules()`` order.
- Exactness, errors before any data moves, no hang and in-place storage are reshard's contracts
  (docs/design.md), stricter than Megatron's: a name missing on one side is an error, not skipped.
- Caches: plans and sessions live in reshard's caches (``clear_plan_cache``); backend services in
  this module's (``get_or_create_service``, ``clear_service_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..api import RefitReport, clear_caches, prepare, refit
from ..coordination import failures
from ..extract import unwrap
from ..transform import ReshardTransform
from ..transport.copy_service import CopyService
from .megatron_mxfp8 import setup_mxfp8
from .megatron_service import MegatronServiceAdapter, is_copy_service_like

RefitBackendName = Literal["nccl", "gloo", "nvshmem"]
Model = Any  # a module, a list/tuple of modules, or None

__all__ = [
    "RefitBackendName",
    "clear_all_caches",
    "clear_plan_cache",
    "clear_service_cache",
    "get_or_create_service",
    "prepare_swap_model_weights",
    "reshard_model_weights",
    "swap_model_weights",
]

_service_cache: dict[tuple[str, tuple[int, ...] | None], CopyService] = {}
_adapters: dict[int, MegatronServiceAdapter] = {}


def get_or_create_service(backend: RefitBackendName, group: dist.ProcessGroup | None = None) -> CopyService:
    """The cached reshard transport ``backend`` over ``group`` (created on first use).

    Raises ``ValueError("Unknown backend '<name>'; ...")`` for a name no installed transport has,
    and ``ReshardError`` when the transport cannot run on this machine (with its reason).
    """
    from ..errors import ReshardError
    from ..transport.registry import get_transport, transport_names

    key = (backend, tuple(dist.get_process_group_ranks(group)) if group is not None else None)
    service = _service_cache.get(key)
    if service is not None:
        return service
    known = transport_names()
    if backend not in known:
        raise ValueError(f"Unknown backend '{backend}'; installed transports: {', '.join(known) or 'none'}")
    cls = get_transport(backend)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise ReshardError(f"transport '{backend}' is unavailable here: {reason}")
    service = _service_cache[key] = cls(group)
    return service


def clear_service_cache() -> None:
    """Close and forget the services ``get_or_create_service`` created."""
    for service in _service_cache.values():
        service.close()
    _service_cache.clear()
    _adapters.clear()


def clear_plan_cache() -> None:
    """Forget every prepared refit session and cached plan (``reshard_core.clear_caches()``)."""
    clear_caches()


def clear_all_caches() -> None:
    """``clear_service_cache()`` and ``clear_plan_cache()``."""
    clear_service_cache()
    clear_plan_cache()


def prepare_swap_model_weights(
    src_model: Model,
    target_model: Model,
    group: dist.ProcessGroup | None = None,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    *,
    refit_method: RefitBackendName | Any = "gloo",
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None,
) -> None:
    """Build and cache the refit plan without moving weights. Collective over ``group``, like
    ``swap_model_weights``.

    A later ``swap_model_weights`` with the same models, ``refit_method``, ``group`` and
    ``transform`` reuses the whole prepared session; with other ones it still reuses the plan.
    """
    _check_offsets(src_rank_offset, dst_rank_offset)
    _check_transform(transform)
    src, dst = _cores(src_model, "Source"), _cores(target_model, "Target")
    with failures.watched(group):  # a refused destination is read by the ranks waiting for it
        for core in dst or ():
            setup_mxfp8(core)
    prepare(src, dst, transport=_service(refit_method, group), group=group, transform=transform)


def swap_model_weights(
    src_model: Model,
    target_model: Model,
    refit_method: RefitBackendName | Any,
    group: dist.ProcessGroup | None = None,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None,
) -> RefitReport:
    """Copy ``src_model``'s weights into ``target_model`` across their layouts, in place.

    Collective over ``group``. ``refit_method`` is a backend name or a CopyService (reshard's or
    Megatron's); anything else is Megatron's ``TypeError``. Returns reshard's ``RefitReport``.
    """
    return reshard_model_weights(
        src_model, target_model, _service(refit_method, group), group=group,
        src_rank_offset=src_rank_offset, dst_rank_offset=dst_rank_offset, transform=transform,
    )  # fmt: skip


def reshard_model_weights(
    src_model: Model,
    target_model: Model,
    service: Any,
    group: dist.ProcessGroup | None = None,
    src_rank_offset: int = 0,
    dst_rank_offset: int = 0,
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None,
) -> RefitReport:
    """``swap_model_weights`` with a CopyService instance (reshard's or Megatron's)."""
    _check_offsets(src_rank_offset, dst_rank_offset)
    _check_transform(transform)
    transport = _service(service, group)
    src, dst = _cores(src_model, "Source"), _cores(target_model, "Target")
    with failures.watched(group):  # a refused destination is read by the ranks waiting for it
        for core in dst or ():
            setup_mxfp8(core)
    report = refit(src, dst, transport=transport, group=group, transform=transform)
    for core in dst or ():
        run_post_refit_hooks(core)
    return report


def run_post_refit_hooks(module: torch.nn.Module) -> int:
    """Call ``post_refit()`` (else ``refresh_cache()``) on every module of ``module`` defining one,
    in ``modules()`` order; return how many were called."""
    called = 0
    for sub in module.modules():
        for name in ("post_refit", "refresh_cache"):
            hook = getattr(sub, name, None)
            if callable(hook) and not isinstance(hook, torch.nn.Module):
                hook()
                called += 1
                break
    return called


def _service(refit_method: Any, group: dist.ProcessGroup | None) -> CopyService:
    """A reshard transport for ``refit_method`` (a name, a reshard or a Megatron CopyService)."""
    if isinstance(refit_method, str):
        return get_or_create_service(refit_method, group)
    if isinstance(refit_method, CopyService):
        return refit_method
    if is_copy_service_like(refit_method):
        adapter = _adapters.get(id(refit_method))
        if adapter is None or adapter.service is not refit_method:
            adapter = _adapters[id(refit_method)] = MegatronServiceAdapter(refit_method, group)
        return adapter
    raise TypeError("refit_method must be a str backend name or a CopyService instance")


def _check_offsets(src_rank_offset: int, dst_rank_offset: int) -> None:
    if src_rank_offset or dst_rank_offset:
        raise ValueError(
            f"src_rank_offset={src_rank_offset}, dst_rank_offset={dst_rank_offset}: reshard refits "
            "within one torch.distributed world whose process groups already hold global ranks; "
            "build both models' groups in that world and pass offsets 0"
        )


def _check_transform(transform: Any) -> None:
    items = tuple(transform) if isinstance(transform, (list, tuple)) else (transform,)
    for t in items:
        if t is not None and not isinstance(t, ReshardTransform):
            raise TypeError(
                f"transform must be a reshard_core.ReshardTransform, got {type(t).__module__}."
                f"{type(t).__name__} (for MXFP8 use reshard_mxfp8.MXFP8ReshardTransform)"
            )


def _cores(model: Model, side: str) -> list[torch.nn.Module] | None:
    """The unwrapped model chunks of one side (None for None), each checked for ``pg_collection``."""
    if model is None:
        return None
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    cores = []
    for chunk in chunks:
        core = unwrap(chunk)
        pgs = getattr(core, "pg_collection", None)
        if pgs is None:
            raise RuntimeError(f"{side} model missing pg_collection required for reshard")
        if side == "Source" and getattr(pgs, "dp", None) is None:
            from megatron.core import parallel_state

            pgs.dp = parallel_state.get_data_parallel_group()
        cores.append(core)
    return cores or None
