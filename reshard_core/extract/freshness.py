"""Sources that are current: finish a trainer's deferred parameter all-gather before a refit reads.

Megatron-Core's ``DistributedDataParallel`` with the distributed optimizer and
``overlap_param_gather=True`` does not all-gather the updated shards in ``optimizer.step()``: each
bucket group's all-gather waits for the next forward's pre-hooks (or, with
``overlap_param_gather_with_optimizer_step``, is left in flight by the step). Between the step and
that forward every rank holds its own fresh shard beside stale copies of all the others, so a
refit there would ship stale weights. ``source_refreshers(src)`` gives the refit one refresher per
source chunk; its ``refresh_source()`` (run before every execution, see ``Session.refreshers``)
finishes exactly the pending all-gathers, as that forward would, and does nothing when none is.

The wrapper may be passed itself, in a list of chunks, or left out (the bare module inside): it is
then found through the forward pre-hook it registers on every module it wraps. Megatron-Core 0.16
contract relied on: ``ddp_config.use_distributed_optimizer`` / ``overlap_param_gather``,
``bucket_groups`` + ``expert_parallel_bucket_groups``, and per bucket group
``param_gather_dispatched``, ``param_gather_handle``, ``finish_param_sync(skip_next_bucket_dispatch)``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .context import ExtractError

_HOOK = "DistributedDataParallel._make_forward_pre_hook.<locals>.hook"
_DDP_API = ("bucket_groups", "expert_parallel_bucket_groups")
_GROUP_API = ("param_gather_dispatched", "param_gather_handle", "finish_param_sync")


class ParamGatherRefresher:
    """``refresh_source()`` finishes one source chunk's pending parameter all-gathers (collective
    over its data-parallel group when one is pending). The chunk is held weakly."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self._chunk = weakref.ref(chunk)

    def refresh_source(self) -> None:
        chunk = self._chunk()
        if chunk is not None:
            finish_param_gathers(chunk)


def source_refreshers(model: Any) -> list[ParamGatherRefresher]:
    """One ``ParamGatherRefresher`` per module chunk of ``model`` (a source: a module, a list of
    chunks, or None). Raises ``ExtractError`` now, before any data moves, when a chunk's deferred
    all-gather could not be finished (see ``megatron_ddp``)."""
    chunks = [c for c in _chunks(model) if isinstance(c, torch.nn.Module)]
    for chunk in chunks:
        megatron_ddp(chunk)
    return [ParamGatherRefresher(chunk) for chunk in chunks]


def finish_param_gathers(model: Any) -> int:
    """Finish every pending deferred parameter all-gather of ``model``'s chunks; return how many
    bucket groups were finished (0: nothing was pending, nothing was done).

    Collective over each wrapper's data-parallel group when something is pending: every rank of that
    group must call it. They agree on what is pending because Megatron's own forward relies on the
    same state being identical on each of them. Raises ``ExtractError`` as ``megatron_ddp``.
    """
    finished = 0
    for chunk in _chunks(model):
        ddp = megatron_ddp(chunk)
        if ddp is None:
            continue
        for group in pending_gathers(ddp):
            # What the forward pre-hook does (dispatch if needed, wait, FP8/MXFP8 post-processing),
            # without dispatching the next group ahead: every pending group is finished here in turn.
            group.finish_param_sync(skip_next_bucket_dispatch=True)
            finished += 1
    return finished


def pending_gathers(ddp: Any) -> list[Any]:
    """The bucket groups (dense, then expert-parallel) of a Megatron DDP whose parameter all-gather
    is incomplete: not dispatched since the last gradient sync, or dispatched and still in flight."""
    return [g for g in _groups(ddp) if not g.param_gather_dispatched or g.param_gather_handle is not None]


def megatron_ddp(chunk: Any) -> Any | None:
    """The Megatron-Core ``DistributedDataParallel`` with deferred parameter all-gathers (distributed
    optimizer and ``overlap_param_gather=True``) behind one source chunk, or None when there is none.

    ``chunk`` is the wrapper itself or a module inside one, whose wrapper is then read from the
    forward pre-hook it registered there. Raises ``ExtractError`` naming ``overlap_param_gather=True``
    when such a hook is found but its wrapper cannot be read from it, or when the wrapper lacks the
    bucket-group API this module drives (another Megatron-Core version).
    """
    ddp = chunk if _is_megatron_ddp(chunk) else _hooked_wrapper(chunk)
    if ddp is None or not (ddp.ddp_config.use_distributed_optimizer and ddp.ddp_config.overlap_param_gather):
        return None
    lacking = [name for name in _DDP_API if not hasattr(ddp, name)] or sorted(
        {f"bucket group {name}" for g in _groups(ddp) for name in _GROUP_API if not hasattr(g, name)}
    )
    if lacking:
        raise _refusal(chunk, f"no {', '.join(lacking)}: not Megatron-Core 0.16's API")
    return ddp


def _hooked_wrapper(module: Any) -> Any | None:
    """The Megatron DDP whose forward pre-hook is registered on ``module``, or None."""
    for hook in getattr(module, "_forward_pre_hooks", {}).values():
        if getattr(hook, "__qualname__", "") != _HOOK:
            continue
        # The hook is a closure over its wrapper (``self``): the only way back from the module to it.
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=False))
        owner = cells["self"].cell_contents if "self" in cells else None
        if not _is_megatron_ddp(owner):
            raise _refusal(module, "the wrapper cannot be read from its forward pre-hook")
        return owner
    return None


def _is_megatron_ddp(obj: Any) -> bool:
    return type(obj).__name__ == "DistributedDataParallel" and hasattr(obj, "ddp_config")


def _groups(ddp: Any) -> list[Any]:
    return list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)


def _chunks(model: Any) -> list[Any]:
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _refusal(chunk: Any, why: str) -> ExtractError:
    return ExtractError(
        f"source {type(chunk).__name__}: Megatron-Core DistributedDataParallel with "
        f"overlap_param_gather=True defers the parameter all-gather after optimizer.step() to the next "
        f"forward, and reshard cannot finish it ({why}), so the shards of other data-parallel ranks may "
        f"be stale; pass the DistributedDataParallel itself as the source, or set overlap_param_gather=False"
    )
