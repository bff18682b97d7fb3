"""``TransferGroup``: the ranks of separate jobs joined into one group that refits run over.

A trainer job and an inference engine each have a ``torch.distributed`` world of their own (or
none): an engine such as vLLM starts its workers itself, in a world of its own. ``TransferGroup.join``
meets them at one TCPStore address (hosted by rank 0) and builds one process group of ``size``
ranks over it, without the default world. Each job takes a contiguous range of its ranks,
``job_ranks`` (a trainer of T ranks ``range(0, T)``, an engine of N workers ``range(T, T + N)``), in
the order of its own world's ranks.

Pass the group as ``group=`` to ``refit`` / ``prepare``: each side's models are still read in its own
job's ranks (DTensor meshes, Megatron groups, an engine's TP group), and the refit adds the job's
offset (``job_ranks.start``) to every rank of the layouts it reports, so both jobs speak the group's
ranks. Nothing on the refit path consults the default world. The group stays up across refits;
``close()`` ends it (and drops the sessions and transports built on it). Two torchrun jobs use it
the same way as a trainer and an engine::

    group = TransferGroup.join("10.0.0.1", 29600, rank=T + my_rank, size=T + N, job_ranks=range(T, T + N))
    reshard_core.refit(None, engine_model, group=group)  # every engine rank; the trainer passes its model
    group.close()
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import TransportError, first_line
from .store_calls import StoreHost, call, host_of

_BACKENDS = ("gloo", "nccl")
T = TypeVar("T")
ASK_S = 2.0
"""Seconds a question to the store may take after a round failed (its host may be stalled)."""
_serial = itertools.count()


class TransferGroup:
    """One process group over the ranks of several jobs, met at a TCPStore address.

    ``rank`` is this process's rank in the group, ``size`` the group's size, ``job_ranks`` the
    group ranks of this process's own job in its own world's rank order (its ``start`` is the offset
    added to the job's layouts). ``backend`` is the group's collective backend (``"gloo"``: CPU
    collectives, which also carry the refit's small agreement rounds); a transport needing another
    backend (``nccl``) gets one from ``process_group(backend)``. ``timeout`` bounds the rendezvous
    and every collective of the group.
    """

    def __init__(
        self, store: Any, rank: int, size: int, job_ranks: range, *, backend: str = "gloo",
        timeout: float = 60.0, address: str = "",
    ) -> None:  # fmt: skip
        _check_ranks(rank, size, job_ranks)
        if backend not in _BACKENDS:
            raise TransportError(
                f"transfer group: backend must be one of {', '.join(_BACKENDS)}, got {backend!r}"
            )
        self.store, self.rank, self.size, self.job_ranks = store, rank, size, job_ranks
        self.backend, self.timeout, self.address = backend, float(timeout), address
        self.key = ("transfer", next(_serial))
        """Distinguishes this group from every other (also one later joined at the same address)."""
        self._groups: dict[str, Any] = {}
        self._on_close: list[Callable[[Hashable], None]] = []
        self._gathers: dict[str, int] = {}
        self.closed = False
        self.pg = self.process_group(backend)

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        *,
        rank: int,
        size: int | None,
        job_ranks: range,
        backend: str = "gloo",
        timeout: float = 60.0,
        host_store: bool | None = None,
    ) -> TransferGroup:
        """Meet every rank of the group at ``host:port`` and return the group. Collective over all
        ranks, each of which calls it once with its own ``rank``.

        Rank 0 hosts the TCPStore unless ``host_store`` says otherwise. ``size=None`` takes the size
        another rank published (a trainer that does not know how many engine workers will join);
        ranks that pass a size publish it, and a rank passing another size is refused. Raises
        ``TransportError`` naming the address when the store cannot be reached, or when not every
        rank joined within ``timeout`` seconds; when the other side refused (``refuse``), the error's
        ``refusal`` attribute is its reason, and the store's host waits (within ``timeout``) until
        the other ranks of its job have read it.
        """
        if size is not None:
            _check_ranks(rank, size, job_ranks)
        address = f"{host}:{port}"
        hosting = rank == 0 if host_store is None else bool(host_store)
        wait = datetime.timedelta(seconds=timeout)
        rendezvous = StoreHost("rank 0", "join a new transfer group")

        def connect(_: Any) -> Any:
            return dist.TCPStore(host, int(port), None, hosting, timeout=wait, wait_for_workers=False)

        try:  # bounded: a client whose host is stopped waits for its handshake for good
            store = call(_Address(int(port)), connect, timeout + ASK_S, rendezvous)
        except Exception as exc:
            role = "host" if hosting else "reach"
            raise TransportError(
                f"transfer group rank {rank}: could not {role} the rendezvous store at {address} "
                f"within {timeout:g} s: {first_line(exc)}"
            ) from exc
        try:
            size = _agree_size(store, rank, size, address, timeout)
        except _Refused:
            if hosting:  # the other side refused: keep the store until this job's ranks read why
                _wait_for_readers(store, len(job_ranks), timeout)
            raise
        _check_ranks(rank, size, job_ranks)
        return cls(store, rank, size, job_ranks, backend=backend, timeout=timeout, address=address)

    @property
    def offset(self) -> int:
        """Added to a rank of this process's own job to give its rank in the group."""
        return self.job_ranks.start

    def process_group(self, backend: str | None = None) -> Any:
        """The group's process group for ``backend`` (default: the group's own), built on first use.
        Building one is collective over every rank of the group."""
        backend = backend or self.backend
        if self.closed:
            raise TransportError(f"transfer group {self.address or self.key}: used after close()")
        if backend not in self._groups:
            self._groups[backend] = self._build(backend)
        return self._groups[backend]

    def _build(self, backend: str) -> Any:
        store = dist.PrefixStore(f"reshard/transfer/{backend}/", self.store)
        wait = datetime.timedelta(seconds=self.timeout)
        pg = dist.ProcessGroup(store, self.rank, self.size)
        try:
            if backend == "gloo":
                kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
                impl = dist.ProcessGroupGloo(store, self.rank, self.size, wait)
            else:
                kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = wait
                impl = dist.ProcessGroupNCCL(store, self.rank, self.size, options)
        except Exception as exc:
            raise TransportError(
                f"transfer group rank {self.rank} of {self.size} at {self.address}: the {backend} group did "
                f"not form within {self.timeout:g} s (a rank did not join, or joined with another size): "
                f"{first_line(exc)}"
            ) from exc
        impl._set_sequence_number_for_group()
        pg._set_default_backend(kind)
        pg._register_backend(device, kind, impl)
        return pg

    def gather_text(
        self, text: str, *, what: str = "status", missing: str | None = None, ranks: range | None = None
    ) -> list[str]:
        """The ``text`` of every rank in ``ranks`` (default: the whole group), in rank order.
        Collective over those ranks, through the group's store (so it also works when the group's
        process group failed). A rank that did not report within ``timeout`` gets ``missing`` when
        it is given; else ``TransportError`` names those ranks. When the store itself is gone, the
        error names its host, rank 0. The ranks must call it in the same order."""
        if self.closed:
            raise TransportError(f"transfer group {self.address or self.key}: used after close()")
        ranks = range(self.size) if ranks is None else ranks
        tag = "all" if ranks == range(self.size) else f"{ranks.start}-{ranks.stop - 1}"
        self._gathers[tag] = serial = self._gathers.get(tag, 0) + 1
        prefix = f"reshard/transfer/gather/{tag}/{serial}/"
        keys = [prefix + str(r) for r in ranks]
        def gather(store: Any) -> list[str]:
            store.set(prefix + str(self.rank), text.encode())
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return [store.get(k).decode() for k in keys]

        try:  # bounded: a store wait whose host is stalled never returns (its cancel waits for an answer)
            return self.ask_store(gather, self.timeout + ASK_S)
        except Exception as exc:
            absent = _unset(self, keys)
            if absent is None:
                raise TransportError(
                    f"transfer group rank {self.rank}: {what}: the group's store at {self.address} is "
                    f"gone: rank 0, its host, exited or stalled ({first_line(exc)})"
                ) from exc
            absent = [ranks[i] for i in absent]
            if missing is not None:
                return [missing if r in absent else self.store.get(prefix + str(r)).decode() for r in ranks]
            who = f"ranks {absent} did not report" if absent else first_line(exc)
            raise TransportError(
                f"transfer group rank {self.rank}: {what}: {who} within {self.timeout:g} s "
                "(failed, exited or stalled)"
            ) from exc

    def ask_store(self, fn: Callable[[Any], T], seconds: float = ASK_S) -> T:
        """``fn(store)`` on the group's store, bounded: ``StoreSilent`` (a ``TransportError``) naming
        the store's host when it has not answered within ``seconds`` (a TCPStore's ``add`` and
        ``check`` would wait for a stalled host for good)."""
        return call(self.store, fn, seconds, host_of(self))

    @staticmethod
    def refuse(host: str, port: int, reason: str, *, timeout: float = 5.0) -> bool:
        """Tell the ranks joining at ``host:port`` that this side will not join: every rank waiting
        there for the group size raises ``TransportError`` with ``reason``. Best effort (False when
        the store cannot be reached, or the group formed already)."""
        try:
            store = dist.TCPStore(
                host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )  # fmt: skip
            store.compare_set(_SIZE_KEY, "", _REFUSED + reason)
            return store.get(_SIZE_KEY).decode() == _REFUSED + reason
        except Exception:
            return False

    def on_close(self, callback: Callable[[Hashable], None]) -> None:
        """Call ``callback(self.key)`` when the group closes (once per callback; the refit caches
        use it to drop the sessions and transports built on the group)."""
        if callback not in self._on_close:
            self._on_close.append(callback)

    def close(self) -> None:
        """End the group: tell those who asked (``on_close``: the refit caches drop the sessions and
        transports built on it), then release its process groups and the store. Idempotent; the
        group cannot be used afterwards."""
        if self.closed:
            return
        for callback in self._on_close:
            callback(self.key)
        self.closed = True
        for pg in self._groups.values():
            shutdown = getattr(pg, "shutdown", None)
            try:
                if shutdown is not None:
                    shutdown()
            except Exception:  # releasing a broken group is best effort
                pass
        self._groups.clear()
        self.pg = None
        self.store = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return (
            f"TransferGroup(rank={self.rank}, size={self.size}, job_ranks={self.job_ranks}, "
            f"address={self.address!r}, {state})"
        )


_SIZE_KEY = "reshard/transfer/size"
_REFUSED = "refused: "
_READ_KEY = "reshard/transfer/refusal_read"
"""Counts the ranks that read a refusal (the store's host waits for its job's ranks before leaving)."""


class _Refused(TransportError):
    """The other side refused to join (``TransferGroup.refuse``); ``refusal`` is its reason."""

    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


class _Address:
    """A store not yet reached: its port (what ``store_calls`` releases at exit)."""

    def __init__(self, port: int) -> None:
        self.port = port


def _agree_size(store: Any, rank: int, size: int | None, address: str, timeout: float) -> int:
    """The group size: published by the first rank that knows it, read by every other (or the
    reason another side published with ``TransferGroup.refuse`` instead)."""
    def read(store: Any) -> str:
        if size is not None:
            return store.compare_set(_SIZE_KEY, "", str(size)).decode()
        store.wait([_SIZE_KEY])
        return store.get(_SIZE_KEY).decode()

    try:
        published = call(store, read, timeout + ASK_S, StoreHost("rank 0", "join a new transfer group"))
    except Exception as exc:
        raise TransportError(
            f"transfer group rank {rank} at {address}: no rank published the group size within "
            f"{timeout:g} s: {first_line(exc)}"
        ) from exc
    if published.startswith(_REFUSED):
        try:
            store.add(_READ_KEY, 1)
        except Exception:  # the count only keeps the store up for the other readers
            pass
        reason = published[len(_REFUSED) :]
        raise _Refused(f"transfer group rank {rank} at {address}: {reason}", reason)
    if size is not None and int(published) != size:
        raise TransportError(
            f"transfer group rank {rank} at {address}: joined with size {size}, but the group was "
            f"formed with size {published}"
        )
    return int(published)


def _wait_for_readers(store: Any, readers: int, timeout: float) -> None:
    """Until ``readers`` ranks read the refusal, at most ``timeout`` seconds: a rank of the job that
    comes later than the store's host must learn the refusal too, not find the store gone."""
    deadline = time.monotonic() + timeout
    try:
        while store.add(_READ_KEY, 0) < readers and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:
        pass


def _check_ranks(rank: int, size: int, job_ranks: range) -> None:
    if not isinstance(job_ranks, range) or job_ranks.step != 1 or not len(job_ranks):
        raise TransportError(f"transfer group: job_ranks must be a non-empty range, got {job_ranks!r}")
    if not 0 <= job_ranks.start < job_ranks.stop <= size:
        raise TransportError(f"transfer group: job_ranks {job_ranks} do not fit a group of {size} ranks")
    if rank not in job_ranks:
        raise TransportError(f"transfer group: rank {rank} is not in its job's ranks {job_ranks}")


def _unset(group: TransferGroup, keys: list[str]) -> list[int] | None:
    """The ranks whose key is missing, or None when the store cannot be asked (it is gone, or its
    host does not answer within ``ASK_S``)."""
    try:
        return group.ask_store(lambda store: [r for r, k in enumerate(keys) if not store.check([k])])
    except Exception:
        return None
