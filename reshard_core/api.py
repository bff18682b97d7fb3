"""The public refit API: ``refit``, ``prepare``, ``clear_caches`` and the ``RefitReport``.

One refit = extract specs from both models → exchange the compact layout table → plan this rank →
execute the plan over a transport. ``prepare`` does everything but the execution and caches the
result (a ``Session``); later refits whose models still look the same on every rank reuse it and
skip extraction, exchange and planning. "Look the same" is checked locally — the very same model
objects (held by weak reference, so a new model that reuses a dead one's ``id`` never matches),
and each tensor's name, shape, dtype, stride, storage pointer and declared layout — and agreed on
by one tiny all-gather, so a change on any rank makes every rank rebuild (never a stale plan). A
session is dropped when one of its models is garbage collected. ``Session.refit()`` runs a prepared
session without that all-gather (each rank checks only its own models and raises on a change): the
fast path for a training loop that prepares once and refits after every step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import versions
from .errors import PlanError, ReshardError
from .exchange import bounded, exchange_layouts, failures
from .exchange.options import check_options, option_digests
from .exchange.verdict import Problems, raise_if_any
from .execute.delta import DeltaState, DeltaStats
from .execute.executor import execute_plan
from .execute.memo import ExecMemo
from .execute.pool import StagingPool
from .execute.stats import ExecStats
from .execute.verify import raise_mismatches
from .extract import ExtractContext, extract_specs, iter_tensors
from .extract.destinations import destination_problems
from .extract.freshness import source_refreshers
from .formats import ModelFormat, resolve_format
from .build.sides import FormatChoice, agreed_formats, format_code, logical_hint, logical_side
from .plan.cache import cached_plan_rank, clear_plan_cache
from .plan.ops import RankPlan
from .plugins import get_plugin_manager
from .refit_group import RefitGroup, to_refit_ranks, view_of
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
    ``transfer``, ``local``, ``unpack``, ``total``). With ``verify=True``, what this rank checked:
    ``verified_bytes`` (``bytes_received`` + ``bytes_local``, less transformed local copies) and
    ``verified_messages`` (the received messages); both 0 without ``verify``. With ``delta=True``,
    ``delta`` says what moved as deltas and why anything went whole (``execute.delta.DeltaStats``);
    None without ``delta``.
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
    verified_bytes: int = 0
    verified_messages: int = 0
    delta: DeltaStats | None = None

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
    """A prepared refit for one rank: the plan, the local tensors it reads and writes, the transport,
    and the staging buffers its refits reuse (their sizes repeat exactly from refit to refit)."""

    plan: RankPlan
    src_tensors: dict[str, torch.Tensor | None]
    dst_tensors: dict[str, torch.Tensor | None]
    transport: CopyService
    transforms: list[ReshardTransform]
    metadata_bytes: int
    seconds: dict[str, float]
    pool: StagingPool = field(default_factory=StagingPool)
    memo: ExecMemo = field(default_factory=ExecMemo)
    """Reused by every execution of this session (its tensors are fixed; a change rebuilds it)."""
    refreshers: list[Any] = field(default_factory=list)
    """Objects with a ``refresh_source()`` method, called before every execution so no source is
    stale: finishers of Megatron's deferred parameter all-gathers (``extract.freshness``), then
    source specs derived from live data (e.g. a dequantized copy of a quantized param)."""
    models: tuple[weakref.ref, ...] = ()
    """The source modules, then the destination modules, it was built for (weakly held)."""
    signature: tuple = ()
    """``(_model_signature(src), _model_signature(dst))`` when it was built."""
    watched: list[tuple[weakref.ref, str, str, tuple]] = field(default_factory=list)
    """Each tensor of its models: its owner module, ``"_parameters"`` or ``"_buffers"``, the key
    and the fingerprint (modules are held weakly so a session never keeps a model alive)."""
    structure: list[tuple[weakref.ref, tuple]] = field(default_factory=list)
    """Each module of its models, with (weak references to) the children it held."""
    cast: bool = False
    """Prepared with ``cast=True``: its plan may convert dtypes, so every execution casts."""
    verify: bool = False
    """Prepared with ``verify=True``: every execution checks what arrived (``execute.verify``)."""
    delta: DeltaState | None = None
    """Prepared with ``delta=True``: the snapshots and confirmations its delta executions keep."""
    group: Any = None
    """The ``group`` it was prepared over (its peers' failures are read from that group's store)."""
    destinations: tuple[weakref.ref, ...] = ()
    """The destination modules (weakly held): where ``version=`` is recorded."""

    def refit(self, *, cast: bool = False, version: Any = None) -> RefitReport:
        """Run this prepared refit again: the fast path for a loop that calls ``prepare`` once.

        ``reshard_core.refit`` first walks both models and agrees with every rank (one small
        all-gather) that the cached session still fits, and rebuilds it everywhere if not. This
        method skips both: each rank checks that its models still hold the same submodules and that
        every tensor it was prepared with still sits where it was (same module attribute; same
        shape, dtype, stride, storage and layout), and raises ``ReshardError`` before any data moves
        if not or if a model was collected. Its peers then fail with ``TransportError`` within
        ``timeout``; after a change call ``prepare`` again on every rank. After a ``TransportError``
        this session's transport is closed (when reshard made it) and forgotten: call ``prepare`` (or
        ``refit``) again for a fresh one. Collective with every peer of the plan.
        """
        start = time.perf_counter()
        with failures.watched(self.group):
            self._refresh()  # first: Megatron's all-gathers are collective even where a model changed
            problem = self._changed()
            if problem is not None:
                # Not published: ranks whose models changed refuse before any communication and are
                # expected to prepare again at once; a record would stand in their next refit.
                with failures.raised_alike():
                    raise ReshardError(
                        f"rank {self.plan.rank}: the prepared session no longer fits its models ({problem}); "
                        "call reshard_core.prepare() again on every rank"
                    )
            return _report(self, self._run(cast, version), True, time.perf_counter() - start)

    def built_for(self, src: Model, dst: Model, signature: tuple) -> bool:
        """True when ``src``/``dst`` are the very objects this session was built for, unchanged."""
        models = _modules(src) + _modules(dst)
        if len(models) != len(self.models):
            return False
        return all(r() is m for r, m in zip(self.models, models, strict=True)) and self.signature == signature

    def _changed(self) -> str | None:
        """Why this rank's models no longer match the session, or None when they do."""
        if any(ref() is None for ref in self.models):
            return "a model it was prepared for was garbage collected"
        for module, children in self.structure:
            if _children(module()) != children:
                return "a submodule was replaced, added or removed"
        for owner, kind, key, fingerprint in self.watched:
            tensor = getattr(owner(), kind, {}).get(key)
            if tensor is None or _fingerprint(tensor) != fingerprint:
                return "a tensor was replaced, reshaped, moved or re-laid out"
        return None

    def _run(self, cast: bool, version: Any) -> ExecStats:
        """Refresh the sources, execute, and record ``version`` on the destinations once it landed."""
        destinations = [m for m in (ref() for ref in self.destinations) if m is not None]
        versions.begin(destinations)
        self._refresh()
        stats = self._execute(cast or self.cast)
        versions.commit(destinations, version)
        return stats

    def _refresh(self) -> None:
        """Bring every source up to date (``refreshers``) before an execution."""
        with torch.no_grad():
            for source in self.refreshers:
                source.refresh_source()

    def _execute(self, cast: bool) -> ExecStats:
        """Run the plan once. Any error (a ``TransportError`` from inside the transport, a transform
        that raised) forgets the transport: it is closed and dropped from the cache with every
        session using it, so the next ``refit`` builds a fresh one (its peers' state is unknown)."""
        with torch.no_grad():  # destinations are usually leaf Parameters that require grad
            try:
                stats = execute_plan(
                    self.plan, self.src_tensors, self.dst_tensors, self.transport,
                    transform=self.transforms or None, cast=cast, pool=self.pool, memo=self.memo,
                    verify=self.verify, delta=self.delta,
                )  # fmt: skip
                if self.verify:  # every rank raises a mismatch that any receiver found
                    with failures.raised_alike():
                        raise_mismatches(stats, self.group, self.transport.timeout)
                return stats
            except Exception:
                _forget_transport(self.transport)
                raise


@dataclass
class _Cached:
    """A prepared session and the finalizers that drop it when one of its models is collected."""

    session: Session
    finalizers: list[weakref.finalize]


@dataclass(frozen=True)
class _Options:
    """The caller's choices that shape a session (everything of ``prepare`` but the models)."""

    transport: str | CopyService
    group: dist.ProcessGroup | None
    transform: ReshardTransform | Sequence[ReshardTransform] | None
    max_batch_bytes: int | None
    ignore: Sequence[str]
    tied: dict[str, str] | None
    timeout: float | None
    src_format: ModelFormat | str | None = None
    dst_format: ModelFormat | str | None = None
    cast: bool = False
    verify: bool = False
    delta: bool = False

    def key(self, src: Model, dst: Model) -> tuple:
        """The session cache key: model identities plus every option, hashable."""
        t = self.transform
        transforms = (t,) if isinstance(t, ReshardTransform) else tuple(t or ())
        return (
            tuple(id(m) for m in _modules(src)),
            tuple(id(m) for m in _modules(dst)),
            self.transport if isinstance(self.transport, str) else id(self.transport),
            view_of(self.group).key,
            tuple(id(x) for x in transforms),
            self.max_batch_bytes,
            tuple(self.ignore),
            tuple(sorted((self.tied or {}).items())),
            self.timeout,
            _format_key(self.src_format),
            _format_key(self.dst_format),
            bool(self.cast),
            bool(self.verify),
            bool(self.delta),
        )


_sessions: dict[tuple, _Cached] = {}
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
    src_format: ModelFormat | str | None = None,
    dst_format: ModelFormat | str | None = None,
    cast: bool = False,
    verify: bool = False,
    delta: bool = False,
) -> Session:
    """Build (or reuse) this rank's refit session. Collective over ``group`` (default: the world).

    Raises ``PlanError`` on every rank, before any data moves, when the two sides do not match
    (unmatched names, shape or dtype disagreement, holes or double coverage); ``ignore`` (fnmatch
    patterns) and ``tied`` (``{dst_name: src_name}``, e.g. an untied output layer fed from the
    embedding) are the explicit opt-outs. ``src_format``/``dst_format`` (a ``ModelFormat`` or a
    registered name) override the detected model formats; see ``refit``. ``cast=True`` lets a
    source and its destination differ in dtype (see ``refit``). ``verify=True``: every refit of the
    session checks what arrived (see ``refit``). ``delta=True``: its refits move only what changed
    (see ``refit``).
    """
    options = _Options(
        transport, group, transform, max_batch_bytes, ignore, tied, timeout, src_format, dst_format, cast,
        verify=verify, delta=delta,
    )
    with failures.watched(group):
        return _session(src, dst, options)[0]


def _session(src: Model, dst: Model, options: _Options) -> tuple[Session, bool]:
    """``(session, reused)``: the cached session when every rank agrees it is still valid."""
    _check_models(src, dst)
    key = options.key(src, dst)
    signature = (_model_signature(src, "source"), _model_signature(dst, "destination"))
    cached = _sessions.get(key)
    valid = cached is not None and cached.session.built_for(src, dst, signature)
    formats = (resolve_format(src, options.src_format), resolve_format(dst, options.dst_format))
    codes = (format_code(formats[0]), format_code(formats[1]))
    o = options
    digests = option_digests(o.ignore, o.tied, o.max_batch_bytes, o.transport, o.cast, o.verify, o.delta)
    everyone_valid, sides, all_codes, all_digests = _agree(
        valid, src is not None, dst is not None, codes, digests, o.group, o.timeout
    )
    with failures.raised_alike():  # from every rank's agreed values: every rank raises these
        check_options(all_digests)
        if o.max_batch_bytes is not None and (isinstance(o.max_batch_bytes, bool) or o.max_batch_bytes <= 0):
            raise ReshardError(
                f"max_batch_bytes must be a positive number of bytes or None, got {o.max_batch_bytes!r}"
            )
        if everyone_valid:
            return cached.session, True
        choice = agreed_formats(formats, all_codes, sides)
    session = _build(src, dst, sides, options, choice)
    if session.delta is not None and cached is not None:
        session.delta.origin = "the plan was rebuilt (a model's tensors or layout changed on some rank)"
    _remember(key, src, dst, signature, session)
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
    src_format: ModelFormat | str | None = None,
    dst_format: ModelFormat | str | None = None,
    version: Any = None,
    verify: bool = False,
    delta: bool = False,
) -> RefitReport:
    """Copy every weight of ``src`` into ``dst`` across their layouts, in place. Collective over ``group``.

    Either model may be None on a rank that only sends, only receives, or idles. After it returns,
    every destination element equals the source element at the same global coordinate (bit for bit
    when dtypes match; a transform defines its own format). ``cast=True`` accepts a source whose dtype
    differs from its destination's (e.g. an fp32 trainer's router ``expert_bias`` into a bf16 engine):
    the plan carries the destination dtype and the sender converts while packing, so only
    destination-dtype bytes cross the transport (every rank must pass the same ``cast``).
    A failing or vanished peer makes every rank raise ``TransportError`` within ``timeout`` seconds;
    a peer that raised an error of its own is named with that error as soon as it published it.

    Models in different formats (a Megatron-Core ``GPTModel`` and a transformers model, an HF model
    and an engine's fused, padded parameters) are refit through the logical (HF checkpoint) space:
    each side's format maps its parameters onto logical tensors, and only the slices each
    destination rank needs move. Formats are detected (or declared with
    ``reshard_core.declare_format``); ``src_format``/``dst_format`` override them. Models of one
    format (or of none) are refit by their own tensor names.

    ``version``: recorded on this rank's destination modules once all of their tensors landed, and
    read with ``reshard_core.weight_version(dst)`` (None while a refit runs and after one failed).

    ``verify=True`` checks every arrival: each sender checksums the bytes of each tensor slice it
    sends, each receiver recomputes the checksum from the destination region it wrote (a transformed
    tensor: from the received wire bytes) and local copies are checked source against destination;
    a mismatch raises ``ReshardError`` on every rank naming the tensors and the rank pair
    (``verify: rank 0 → rank 2: 1 tensor arrived different from what was sent: w``). Every rank
    must pass the same ``verify``. ``RefitReport.verified_bytes`` says what this rank checked.

    ``delta=True`` moves only what changed since the last refit each receiver confirmed it applied:
    each sender keeps a snapshot of what it sent (memory: the bytes it sends per refit) and sends
    the changed 16-bit words, about 1.3 bytes per changed BF16 element at 1 % density, or a message
    whole where that is smaller; receivers write only the changed words. The first delta refit, and
    any after a failed one, after a plan change or after anything else wrote the destinations, is
    full for the pairs concerned (``RefitReport.delta.note`` says why). The result is the same bit
    for bit. Every rank must pass the same ``delta``; see docs/delta.md.
    """
    start = time.perf_counter()
    options = _Options(
        transport, group, transform, max_batch_bytes, ignore, tied, timeout, src_format, dst_format, cast,
        verify=verify, delta=delta,
    )
    with failures.watched(group):
        session, reused = _session(src, dst, options)
        return _report(session, session._run(cast, version), reused, time.perf_counter() - start)


def clear_caches() -> None:
    """Forget prepared sessions and cached plans, and close cached transports."""
    for cached in _sessions.values():
        for finalizer in cached.finalizers:
            finalizer.detach()
    _sessions.clear()
    clear_plan_cache()
    for service in _transports.values():
        service.close()
    _transports.clear()


def _forget_transport(service: CopyService) -> None:
    """Drop every cached session using ``service``; close it when it is one of ours (``_transports``),
    never one the caller passed in."""
    for key, cached in list(_sessions.items()):
        if cached.session.transport is service:
            for finalizer in cached.finalizers:
                finalizer.detach()
            del _sessions[key]
    for key, cached_service in list(_transports.items()):
        if cached_service is service:
            del _transports[key]
            try:
                service.close()
            except Exception:  # closing a broken transport is best effort; the refit's error matters
                pass


def _report(session: Session, stats: ExecStats, reused: bool, total: float) -> RefitReport:
    seconds = {"extract": 0.0, "exchange": 0.0, "plan": 0.0} if reused else dict(session.seconds)
    seconds.update(_exec_seconds(stats), total=total)
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
        verified_bytes=stats.verified_bytes,
        verified_messages=stats.verified_messages,
        delta=stats.delta,
    )


def _build(src: Model, dst: Model, sides: tuple, options: _Options, choice: FormatChoice) -> Session:
    """Extract (through the models' formats when they differ), agree that no rank failed, exchange
    and plan. ``sides``: the global ranks passing a source / destination model, over which each
    side's plain, undeclared tensors are replicated."""
    o = options
    group = o.group
    view = view_of(group)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    problems = Problems()
    src_specs, dst_specs, padding = [], [], []
    try:
        syncs = source_refreshers(src)  # deferred param all-gathers: finished before other refreshers
        src_specs, _ = _describe(src, "src", view, sides[0], choice, o.ignore, problems)
        dst_specs, padding = _describe(dst, "dst", view, sides[1], choice, o.ignore, problems)
    except ReshardError as exc:
        problems.errors.append(str(exc))
    if not problems.errors and not problems.unmapped:  # else those name the cause more precisely
        problems.errors += destination_problems(dst_specs, view.rank, o.ignore)
    with failures.raised_alike():
        raise_if_any(problems, group, o.timeout)
    transforms = _transforms(dst, dst_specs, o.transform)
    seconds["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    table, exchange_stats = exchange_layouts(src_specs, dst_specs, group=group, timeout=o.timeout)
    seconds["exchange"] = time.perf_counter() - t

    t = time.perf_counter()
    with failures.raised_alike():  # every rank validates the same table
        try:
            plan, _ = cached_plan_rank(
                table,
                view.rank,
                max_batch_bytes=o.max_batch_bytes,
                ignore=o.ignore,
                tied=choice.ties(o.tied),
                group=view.key,
                cast=o.cast,
            )
        except PlanError as exc:
            hint = logical_hint(str(exc)) if choice.mapped else ""
            if not hint:
                raise
            raise PlanError(f"{exc}{hint}") from None
    seconds["plan"] = time.perf_counter() - t
    with torch.no_grad():  # once the plan is valid: a refused refit leaves the destination untouched
        for pad in padding:  # zero-filled once: no source element ever lands there
            pad.zero_()
    return Session(
        plan=plan,
        src_tensors=_tensors(src_specs),
        dst_tensors=_tensors(dst_specs),
        transport=_transport(o.transport, group, o.timeout),
        transforms=transforms,
        metadata_bytes=exchange_stats.bytes,
        seconds=seconds,
        refreshers=[*syncs, *(spec.source for spec in src_specs if hasattr(spec.source, "refresh_source"))],
        cast=o.cast,
        verify=o.verify,
        group=group,
        delta=DeltaState() if o.delta else None,
    )


def _describe(
    model: Model, side: str, view: RefitGroup, ranks: tuple[int, ...], choice: FormatChoice, ignore,
    problems: Problems,
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """This rank's specs of one side (logical when ``choice.mapped``) in refit ranks, and its padding
    views. ``ranks``: the refit ranks holding this side. The model is read in its own job's ranks
    (a ``TransferGroup``'s jobs each have a world of their own), then shifted into refit ranks."""
    if model is None:
        return [], []
    group = None if view.transfer is not None else view.pg
    context = ExtractContext.create(group, replica_ranks=view.own_ranks(ranks))
    if not choice.mapped:
        specs, padding = extract_specs(model, side, group=group, context=context), []
    else:
        specs, padding = logical_side(model, side, choice.of(side), context, ignore, problems)
    return to_refit_ranks(specs, view.offset), padding


def _format_key(fmt: ModelFormat | str | None) -> object:
    return fmt if fmt is None or isinstance(fmt, str) else id(fmt)


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
    key = (transport, view_of(group).key, timeout)
    service = _transports.get(key)
    if service is None:
        cls = get_transport(transport)
        reason = cls.unavailable_reason()
        if reason is not None:
            raise ReshardError(f"transport '{transport}' is unavailable here: {reason}")
        service = _transports[key] = cls(group, timeout=timeout)
    return service


def forget_group(key) -> None:
    """Drop the sessions and close the transports built over the group whose ``RefitGroup.key`` is
    ``key`` (a ``TransferGroup`` being closed)."""
    for session_key, cached in list(_sessions.items()):
        if session_key[3] == key:
            for finalizer in cached.finalizers:
                finalizer.detach()
            del _sessions[session_key]
    for transport_key, service in list(_transports.items()):
        if transport_key[1] == key:
            del _transports[transport_key]
            try:
                service.close()
            except Exception:  # the group is going away; closing its transport is best effort
                pass


def _check_models(src: Model, dst: Model) -> None:
    """``ReshardError`` unless each model is a module, a list of modules (pipeline chunks) or None."""
    for word, model in (("source", src), ("destination", dst)):
        for m in _modules(model):
            if not isinstance(m, torch.nn.Module):
                raise ReshardError(
                    f"the {word} model must be a torch.nn.Module, a list of them (pipeline chunks) or "
                    f"None, not {type(m).__name__}"
                )


def _modules(model: Model) -> list[Any]:
    """The objects a model argument consists of (the modules of a list of chunks)."""
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _remember(key: tuple, src: Model, dst: Model, signature: tuple, session: Session) -> None:
    """Cache ``session`` under ``key``; it is dropped as soon as one of its models is collected."""
    old = _sessions.pop(key, None)
    for finalizer in old.finalizers if old is not None else ():
        finalizer.detach()
    modules = _modules(src) + _modules(dst)
    session.models = tuple(weakref.ref(m) for m in modules)
    session.destinations = tuple(weakref.ref(m) for m in _modules(dst))
    session.signature = signature
    session.watched = _watch(modules)
    session.structure = [(weakref.ref(m), _children(m)) for root in modules for m in root.modules()]
    finalizers = [weakref.finalize(m, _sessions.pop, key, None) for m in modules]
    _sessions[key] = _Cached(session, finalizers)


def _model_signature(model: Model, word: str) -> tuple:
    """What a cached session depends on locally: every tensor's name and ``_fingerprint``.
    ``ReshardError`` for a lazy module's uninitialized tensor (``word`` names the side)."""
    out = []
    for root in _modules(model):
        for name, t, _ in iter_tensors(root):
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
                raise ReshardError(
                    f"the {word} model's tensor {name} is uninitialized (a lazy module's parameter): run "
                    "a forward (or initialize it) before refitting"
                )
            out.append((name, _fingerprint(t)))
    return tuple(out)


_PLAN_ATTRS = (
    "_reshard_layout", "_reshard_name", "_reshard_shape",  # declare_layout
    "tensor_model_parallel", "partition_dim", "partition_stride", "partition_sizes", "allreduce",  # Megatron
)  # fmt: skip
"""Tensor attributes the extractors read (besides a DTensor's placements): a change to any of them
changes the plan. They live in the tensor's ``__dict__``."""


def _fingerprint(tensor: torch.Tensor) -> tuple:
    """A tensor's shape, dtype, stride, storage pointer and everything else the plan depends on: a
    DTensor's placements and ``_PLAN_ATTRS`` (``declare_layout`` layout/name/shape, Megatron's
    partition attributes)."""
    local = getattr(tensor, "_local_tensor", tensor)
    placements = tensor.placements if local is not tensor else None
    held = tensor.__dict__
    attrs = tuple((a, _frozen(held[a])) for a in _PLAN_ATTRS if a in held)
    return (tuple(tensor.shape), tensor.dtype, tuple(local.stride()), local.data_ptr(), placements, attrs)


def _frozen(value: object) -> object:
    """``value`` as a fingerprint holds it: itself when it cannot change in place (None, numbers,
    strings, tuples, frozen layouts and placements; compared with ``==``), else a ``repr`` snapshot
    (a list of partition sizes). Cheaper than ``repr`` for all: ``Session.refit`` checks every
    tensor before every execution."""
    if value is None or isinstance(value, (bool, int, float, str, tuple, torch.Size)):
        return value
    params = getattr(type(value), "__dataclass_params__", None)
    return value if params is not None and params.frozen else repr(value)


def _watch(model: Model) -> list[tuple[weakref.ref, str, str, tuple]]:
    """Where each tensor of ``model`` sits (its owner, ``_parameters`` or ``_buffers``, the key), with
    its ``_fingerprint``: enough to re-check it without walking the module tree again."""
    out = []
    for root in _modules(model):
        for name, tensor, owner in iter_tensors(root):
            key = name.rsplit(".", 1)[-1]
            kind = "_parameters" if owner._parameters.get(key) is tensor else "_buffers"
            out.append((weakref.ref(owner), kind, key, _fingerprint(tensor)))
    return out


def _children(module: torch.nn.Module | None) -> tuple | None:
    """A module's children as weak references (None entries kept; None for a collected module)."""
    if module is None:
        return None
    return tuple(c if c is None else weakref.ref(c) for c in module._modules.values())


def _agree(
    valid: bool,
    has_src: bool,
    has_dst: bool,
    codes: tuple[int, int],
    digests: tuple[int, ...],
    group,
    timeout: float | None,
) -> tuple[bool, tuple[tuple[int, ...], tuple[int, ...]], dict[int, tuple[int, int]], dict[int, tuple]]:
    """One tiny all-gather over ``group``: whether the cached session is valid on every rank, which
    global ranks pass a source and a destination model, each rank's ``(src, dst)`` format codes
    (``build.sides.format_code``) and its option digests (``exchange.options``). Bounded by
    ``timeout`` when given."""
    view = view_of(group)
    device = "cuda" if view.backend == "nccl" else "cpu"
    flags = [int(valid), int(has_src), int(has_dst), *codes, *digests]
    mine = torch.tensor(flags, dtype=torch.int32, device=device)
    ranks = view.ranks
    gathered = torch.empty(len(flags) * len(ranks), dtype=torch.int32, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = gather(gathered, mine, group=view.pg, async_op=True)
    bounded.wait(work, timeout, group, "refit could not start")
    rows = gathered.view(len(ranks), len(flags)).cpu().tolist()
    src_ranks = tuple(r for r, f in zip(ranks, rows, strict=True) if f[1])
    dst_ranks = tuple(r for r, f in zip(ranks, rows, strict=True) if f[2])
    codes_by_rank = {r: (f[3], f[4]) for r, f in zip(ranks, rows, strict=True)}
    digests_by_rank = {r: tuple(f[5:]) for r, f in zip(ranks, rows, strict=True)}
    return all(f[0] for f in rows), (src_ranks, dst_ranks), codes_by_rank, digests_by_rank


def _exec_seconds(stats: ExecStats) -> dict[str, float]:
    return {
        "pack": stats.seconds_pack,
        "transfer": stats.seconds_transfer,
        "local": stats.seconds_local,
        "unpack": stats.seconds_unpack,
    }
