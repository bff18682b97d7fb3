"""The public refit API: ``refit``, ``prepare``, ``clear_caches`` and the ``RefitReport``.

One refit = extract specs from both models → exchange the compact layout table → plan this rank →
execute the plan over a transport. ``prepare`` does everything but the execution and caches the
result (a ``Session``); later refits whose models still look the same on every rank reuse it and
skip extraction, exchange and planning. "Look the same" is checked locally from each tensor's name,
shape, dtype, stride, storage pointer and declared layout, and agreed on by one tiny all-reduce, so a
change on any rank makes every rank rebuild (never a stale plan).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import ReshardError
from .exchange import exchange_layouts
from .execute.executor import execute_plan
from .execute.stats import ExecStats
from .extract import extract_specs, iter_tensors
from .plan.cache import cached_plan_rank, clear_plan_cache
from .plan.ops import RankPlan
from .plugins import get_plugin_manager
from .specs import TensorSpec
from .transform import ReshardTransform
from .transport.copy_service import CopyService
from .transport.registry import get_transport

Model = Any  # an nn.Module, a list of modules (virtual pipeline chunks), or None


@dataclass
class RefitReport:
    """What one ``refit`` did on this rank.

    Bytes: ``bytes_sent`` / ``bytes_received`` crossed the transport, ``bytes_local`` was copied
    inside the rank. ``messages``: transport messages this rank sent. ``seconds``: per phase
    (``extract``, ``exchange``, ``plan`` are zero when the prepared session was reused; ``pack``,
    ``transfer``, ``local``, ``unpack``, ``total``).
    """

    rank: int
    transport: str
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages: int
    batches: int
    peak_staging_bytes: int
    metadata_bytes: int
    reused_plan: bool
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_remote(self) -> int:
        return self.bytes_sent

    def __str__(self) -> str:
        mb = 1 / 2**20
        return (
            f"rank {self.rank}: sent {self.bytes_sent * mb:.1f} MiB, "
            f"received {self.bytes_received * mb:.1f} MiB, local {self.bytes_local * mb:.1f} MiB, "
            f"{self.messages} messages, {self.batches} batches, "
            f"{self.seconds.get('total', 0.0):.3f} s ({'cached plan' if self.reused_plan else 'new plan'})"
        )


@dataclass
class Session:
    """A prepared refit for one rank: the plan, the local tensors it reads and writes, the transport."""

    plan: RankPlan
    src_tensors: dict[str, torch.Tensor | None]
    dst_tensors: dict[str, torch.Tensor | None]
    transport: CopyService
    transforms: list[ReshardTransform]
    metadata_bytes: int
    seconds: dict[str, float]


_sessions: dict[tuple, tuple[tuple, Session]] = {}
_transports: dict[tuple, CopyService] = {}


def prepare(
    src: Model,
    dst: Model,
    *,
    transport: str | CopyService = "gloo",
    group: dist.ProcessGroup | None = None,
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None,
    max_batch_bytes: int | None = None,
    ignore: Sequence[str] = (),
    tied: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Session:
    """Build (or reuse) this rank's refit session. Collective over ``group`` (default: the world).

    Raises ``PlanError`` on every rank, before any data moves, when the two sides do not match
    (unmatched names, shape or dtype disagreement, holes or double coverage); ``ignore`` (fnmatch
    patterns) and ``tied`` (``{dst_name: src_name}``, e.g. an untied output layer fed from the
    embedding) are the explicit opt-outs.
    """
    options = (transport, group, transform, max_batch_bytes, ignore, tied, timeout)
    return _session(src, dst, *options)[0]


def _session(src, dst, *options) -> tuple[Session, bool]:
    """``(session, reused)``: the cached session when every rank agrees it is still valid."""
    key = _options_key(src, dst, *options)
    signature = (_model_signature(src), _model_signature(dst))
    cached = _sessions.get(key)
    if _everyone(cached is not None and cached[0] == signature, options[1]):
        return cached[1], True
    session = _build(src, dst, *options)
    _sessions[key] = (signature, session)
    return session, False


def refit(
    src: Model,
    dst: Model,
    *,
    transport: str | CopyService = "gloo",
    group: dist.ProcessGroup | None = None,
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None,
    max_batch_bytes: int | None = None,
    ignore: Sequence[str] = (),
    tied: dict[str, str] | None = None,
    timeout: float | None = None,
    cast: bool = False,
) -> RefitReport:
    """Copy every weight of ``src`` into ``dst`` across their layouts, in place. Collective over ``group``.

    Either model may be None on a rank that only sends, only receives, or idles. After it returns,
    every destination element equals the source element at the same global coordinate (bit for bit
    when dtypes match; ``cast=True`` converts between dtypes, a transform defines its own format).
    A failing or vanished peer makes every rank raise ``TransportError`` within ``timeout`` seconds.
    """
    start = time.perf_counter()
    session, reused = _session(src, dst, transport, group, transform, max_batch_bytes, ignore, tied, timeout)
    with torch.no_grad():  # destinations are usually leaf Parameters that require grad
        stats = execute_plan(
            session.plan, session.src_tensors, session.dst_tensors, session.transport,
            transform=session.transforms or None, cast=cast,
        )
    seconds = {"extract": 0.0, "exchange": 0.0, "plan": 0.0} if reused else dict(session.seconds)
    seconds.update(_exec_seconds(stats), total=time.perf_counter() - start)
    return RefitReport(
        rank=session.plan.rank,
        transport=session.transport.name,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        bytes_local=stats.bytes_local,
        messages=stats.messages,
        batches=stats.batches,
        peak_staging_bytes=stats.peak_staging_bytes,
        metadata_bytes=0 if reused else session.metadata_bytes,
        reused_plan=reused,
        seconds=seconds,
    )


def clear_caches() -> None:
    """Forget prepared sessions and cached plans, and close cached transports."""
    _sessions.clear()
    clear_plan_cache()
    for service in _transports.values():
        service.close()
    _transports.clear()


def _build(src, dst, transport, group, transform, max_batch_bytes, ignore, tied, timeout) -> Session:
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    src_specs = extract_specs(src, "src", group=group) if src is not None else []
    dst_specs = extract_specs(dst, "dst", group=group) if dst is not None else []
    transforms = _transforms(dst, dst_specs, transform)
    seconds["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    table, exchange_stats = exchange_layouts(src_specs, dst_specs, group=group)
    seconds["exchange"] = time.perf_counter() - t

    t = time.perf_counter()
    rank = dist.get_rank()
    plan, _ = cached_plan_rank(
        table, rank, max_batch_bytes=max_batch_bytes, ignore=ignore, tied=tied, group=_group_key(group)
    )
    seconds["plan"] = time.perf_counter() - t
    return Session(
        plan=plan,
        src_tensors=_tensors(src_specs),
        dst_tensors=_tensors(dst_specs),
        transport=_transport(transport, group, timeout),
        transforms=transforms,
        metadata_bytes=exchange_stats.bytes,
        seconds=seconds,
    )


def _transforms(dst: Model, dst_specs: list[TensorSpec], given) -> list[ReshardTransform]:
    """The caller's transforms plus those plugins attach for ``dst`` (``reshard_transforms`` hook)."""
    found = [given] if isinstance(given, ReshardTransform) else list(given or ())
    if dst is not None:
        found += [t for t in get_plugin_manager().hook.reshard_transforms(model=dst, specs=dst_specs) if t]
    return found


def _tensors(specs: list[TensorSpec]) -> dict[str, torch.Tensor | None]:
    return {spec.meta.name: spec.tensor for spec in specs}


def _transport(transport: str | CopyService, group, timeout: float | None) -> CopyService:
    if isinstance(transport, CopyService):
        return transport
    key = (transport, _group_key(group), timeout)
    service = _transports.get(key)
    if service is None:
        cls = get_transport(transport)
        reason = cls.unavailable_reason()
        if reason is not None:
            raise ReshardError(f"transport '{transport}' is unavailable here: {reason}")
        service = _transports[key] = cls(group, timeout=timeout)
    return service


def _group_key(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else (-1, dist.get_world_size())


def _options_key(src, dst, transport, group, transform, max_batch_bytes, ignore, tied, timeout) -> tuple:
    transforms = (transform,) if isinstance(transform, ReshardTransform) else tuple(transform or ())
    transport_key = transport if isinstance(transport, str) else id(transport)
    return (
        id(src), id(dst), transport_key, _group_key(group), tuple(id(t) for t in transforms),
        max_batch_bytes, tuple(ignore), tuple(sorted((tied or {}).items())), timeout,
    )


def _model_signature(model: Model) -> tuple:
    """What a cached session depends on locally: every tensor's name, shape, dtype, stride, storage
    pointer, DTensor placements and declared layout."""
    if model is None:
        return ()
    roots = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for root in roots:
        for name, tensor, _ in iter_tensors(root):
            local = getattr(tensor, "_local_tensor", tensor)
            out.append((
                name, tuple(tensor.shape), tensor.dtype, tuple(local.stride()), local.data_ptr(),
                repr(getattr(tensor, "placements", None)), repr(getattr(tensor, "_reshard_layout", None)),
            ))
    return tuple(out)


def _everyone(flag: bool, group) -> bool:
    """True when ``flag`` holds on every rank of ``group`` (one tiny all-reduce)."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def _exec_seconds(stats: ExecStats) -> dict[str, float]:
    return {
        "pack": stats.seconds_pack,
        "transfer": stats.seconds_transfer,
        "local": stats.seconds_local,
        "unpack": stats.seconds_unpack,
    }
