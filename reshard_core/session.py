"""``Session``: a prepared refit for one rank, and how it runs again.

``prepare`` (``api``) builds one (``preparation.pipeline``) and caches it (``session_cache``); later
refits whose models still look the same on every rank reuse it and skip extraction, exchange and
planning. ``Session.refit()`` runs it without the agreement round: each rank checks only its own
models (``fingerprints``), and one flag in the start round makes every rank raise on a change.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fingerprints, versions
from .coordination import failures
from .coordination.agree import finish_together, start_together
from .errors import ReshardError
from .execute.delta_state import DeltaState
from .execute.executor import execute_plan
from .execute.memo import ExecMemo
from .execute.pool import StagingPool
from .execute.stats import ExecStats
from .execute.verify import raise_mismatches
from .options import RefitOptions
from .plan.ops import RankPlan
from .report import RefitReport
from .transform import ReshardTransform
from .transport.copy_service import CopyService


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
    options: RefitOptions
    """The options it was prepared with (``cast``, ``verify`` and ``group`` shape every execution)."""
    seen: fingerprints.ModelsSeen
    """The models it was prepared for, as they were then (``fingerprints.ModelsSeen``)."""
    pool: StagingPool = field(default_factory=StagingPool)
    memo: ExecMemo = field(default_factory=ExecMemo)
    """Reused by every execution of this session (its tensors are fixed; a change rebuilds it)."""
    refreshers: list[Any] = field(default_factory=list)
    """Objects with a ``refresh_source()`` method, called before every execution so no source is
    stale: finishers of Megatron's deferred parameter all-gathers (``extract.freshness``), then
    source specs derived from live data (e.g. a dequantized copy of a quantized param)."""
    delta: DeltaState | None = None
    """Prepared with ``delta=True``: the snapshots and confirmations its delta executions keep."""
    on_failure: Callable[[CopyService], None] | None = None
    """Called with the transport when an execution failed (the cache drops it and the sessions
    using it: its peers' state is unknown)."""

    def refit(self, *, cast: bool = False, version: Any = None) -> RefitReport:
        """Run this prepared refit again: the fast path for a loop that calls ``prepare`` once.

        ``reshard_core.refit`` first walks both models and agrees with every rank (one small
        all-gather) that the cached session still fits, and rebuilds it everywhere if not. This
        method skips both: each rank checks that its models still hold the same submodules and that
        every tensor it was prepared with still sits where it was (same module attribute; same
        shape, dtype, stride, storage and layout); if not, or if a model was collected, every rank
        raises that rank's ``ReshardError`` alike before any data moves (the start round carries
        it); after a change call ``prepare`` again on every rank. After a ``TransportError``
        this session's transport is closed (when reshard made it) and forgotten: call ``prepare`` (or
        ``refit``) again for a fresh one. Collective with every peer of the plan.
        """
        start = time.perf_counter()
        o = self.options
        with failures.watched(o.group):
            self.refresh()  # first: Megatron's all-gathers are collective even where a model changed
            problem = self.seen.change()
            error = None
            if problem is not None:
                error = ReshardError(
                    f"the prepared session no longer fits its models ({problem}); call "
                    "reshard_core.prepare() again on every rank"
                )
            with failures.raised_alike():  # a rank whose models changed still joins, with its error
                start_together(error, o.group, o.timeout)
            stats = self._execute_recorded(cast, version)  # the sources were refreshed above
            return self.report(stats, reused=True, total=time.perf_counter() - start)

    @property
    def models(self) -> tuple[weakref.ref, ...]:
        """The source then destination modules it was prepared for (weakly held)."""
        return self.seen.models

    def built_for(self, src: Any, dst: Any, signature: tuple) -> bool:
        """True when ``src``/``dst`` are the very objects this session was built for, unchanged."""
        return self.seen.same_objects(src, dst, signature)

    def run(self, cast: bool, version: Any) -> ExecStats:
        """Refresh the sources, execute, and record ``version`` on the destinations once it landed."""
        self.refresh()
        return self._execute_recorded(cast, version)

    def refresh(self) -> None:
        """Bring every source up to date (``refreshers``) before an execution."""
        with torch.no_grad():
            for source in self.refreshers:
                source.refresh_source()

    def report(self, stats: ExecStats, *, reused: bool, total: float) -> RefitReport:
        """The ``RefitReport`` of one execution (``reused``: this session was not built for it)."""
        setup = None if reused else self.seconds
        return RefitReport.of(self.plan.rank, self.transport.name, stats, setup, self.metadata_bytes, total)

    def _execute_recorded(self, cast: bool, version: Any) -> ExecStats:
        """Execute on fresh sources and record ``version`` on the destinations once it landed."""
        destinations = [m for m in (ref() for ref in self.seen.destinations) if m is not None]
        versions.begin(destinations)
        stats = self._execute(cast or self.options.cast)
        versions.commit(destinations, version)
        return stats

    def _execute(self, cast: bool) -> ExecStats:
        """Run the plan once. Any error (a ``TransportError`` from inside the transport, a transform
        that raised) forgets the transport: it is closed and dropped from the cache with every
        session using it, so the next ``refit`` builds a fresh one (its peers' state is unknown)."""
        with torch.no_grad():  # destinations are usually leaf Parameters that require grad
            try:
                stats = execute_plan(
                    self.plan, self.src_tensors, self.dst_tensors, self.transport,
                    transform=self.transforms or None, cast=cast, pool=self.pool, memo=self.memo,
                    verify=self.options.verify, delta=self.delta,
                )  # fmt: skip
                with failures.raised_alike():  # the closing round: every rank succeeds, or none does
                    finish_together(self.options.group, self.transport.timeout)
                    if self.options.verify:  # then every rank raises a mismatch any receiver found
                        raise_mismatches(stats, self.options.group, self.transport.timeout)
                return stats
            except Exception:
                if self.on_failure is not None:
                    self.on_failure(self.transport)
                raise
