"""A ``CopyService`` base over torch.distributed point-to-point ops, shared by the Gloo and NCCL transports.

Ops are queued by ``submit_send``/``submit_recv`` and issued together by ``start()``, which returns an
``InFlight`` round whose ``wait()`` blocks until all of them completed; ``run()`` is ``start().wait()``.
The split lets the executor pack the next batch while this one is on the wire.

Pairing is by submission order: the n-th send from A to B in a round matches the n-th receive on B
from A (zero-byte ops are skipped on both sides). Sizes must agree: Gloo kills a process that
receives more bytes than its buffer holds. Every tensor travels as its raw bytes
(``view(torch.uint8)``), so any dtype, float8 included, arrives bit for bit. Ranks are refit
ranks (``reshard_core.coordination.refit_group``): global ranks, or a ``TransferGroup``'s own;
``group`` (default: the world) limits who may be a peer. When ``group``'s backend is not the one the
transport needs, the transport builds its own group over the same ranks with ``dist.new_group``,
which every rank of the world must do together (a ``TransferGroup`` builds it over its own store
instead).

Failure: a round that does not finish within ``timeout`` seconds, or whose peer vanished, raises
``TransportError`` naming the failed op (direction, peer rank, task id, bytes) and every other
unfinished op. The backend is then told to give up on the unfinished ops (Gloo closes those pairs, so
the peers fail at once instead of waiting out their own timeout; NCCL aborts the communicator), and
the group must be treated as broken. Buffers of a failed round stay referenced for the life of the
process, because a backend may still write into them. A transport that ``reads_failure_board`` ends
a round early, with ``PeerFailed``, when a peer published its own error during the refit.

Public for transport plugins (``reshard_core.transport``): ``P2PCopyService`` and its subclass
protocol, ``QueuedOp``, ``Issued``, ``InFlight``, ``as_bytes``, ``remaining``, ``poll_until``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..coordination import failures, watcher
from ..coordination.refit_group import view_of
from ..coordination.transfer_group import TransferGroup
from ..errors import TransportError, first_line
from .copy_service import CopyService

_KEPT_ALIVE: list[Any] = []  # given-up rounds: their buffers must outlive any late write by the backend
_MAX_LISTED = 8


@dataclass
class QueuedOp:
    """One submitted send or receive. ``wire`` is what the backend moves (set by the subclass)."""

    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    task_id: int
    wire: torch.Tensor | None = None

    def describe(self) -> str:
        where = "to" if self.kind == "send" else "from"
        return f"{self.kind} {where} rank {self.peer} (task {self.task_id}, {self.tensor.nbytes} bytes)"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensor`` as a flat uint8 view of the same memory."""
    return tensor.reshape(-1).view(torch.uint8)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic`` based), never below 1 ms; None = no limit."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.001)


def poll_until(done: Callable[[], bool], deadline: float) -> None:
    """Return once ``done()`` is true; raise ``TimeoutError`` when ``deadline`` passes first."""
    pause = 5e-5
    while not done():
        if time.monotonic() >= deadline:
            raise TimeoutError("timed out")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def describe_failure(exc: BaseException, timeout: float | None) -> str:
    """A one-line reason for a backend error, in our words where we recognise it."""
    text = first_line(exc)
    low = text.lower()
    if "timed out" in low or isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g} s" if timeout is not None else "timed out"
    if "connection closed" in low or "connection reset" in low:
        return "connection closed by the peer (it exited, failed or gave up)"
    return text


def list_ops(ops: list[QueuedOp]) -> str:
    """The first ``_MAX_LISTED`` ops described, then how many more there are."""
    shown = ", ".join(op.describe() for op in ops[:_MAX_LISTED])
    return shown + (f" and {len(ops) - _MAX_LISTED} more" if len(ops) > _MAX_LISTED else "")


@dataclass
class Issued:
    """One backend request (``work``) and the queued ops it completes."""

    work: Any
    ops: list[QueuedOp]


class InFlight:
    """A started round; ``wait()`` returns when every op landed, or raises ``TransportError``."""

    def __init__(self, service: P2PCopyService, ops: list[QueuedOp], issued: list[Issued]):
        self.service = service
        self.ops = ops
        self.issued = issued
        self.done = not ops

    def wait(self) -> None:
        if not self.done:
            self.service._complete(self)
            self.done = True

    def abandon(self) -> None:
        """Give up on the round without waiting (after another round failed): its buffers stay
        referenced for the life of the process and the backend is told to release the peers."""
        if self.done:
            return
        self.done = True
        self.service.keep_alive(self)
        if not self.service.closed:  # a transport that gave up already (NCCL abort) has no comm left
            self.service._give_up(self, -1)


class P2PCopyService(CopyService):
    """Queue, issue and wait point-to-point ops; subclasses say how tensors reach the backend.

    Subclass protocol (the underscore marks a hook the base calls, not a private one). Set
    ``backend`` (the torch.distributed backend name) and ``reads_failure_board``; implement
    ``_issue(ops)`` (start the ops, set each ``op.wire``, return ``Issued`` records) and
    ``_wait_issued(issued, deadline)`` (block until done, raising once ``deadline`` passes); override
    as needed ``_check_tensor(op, what)`` (device rules), ``_finish(ops)`` (after every op of a round
    completed, e.g. copy staged data back), ``_give_up(flight, failed_index)`` (after a failure,
    release the peers; best effort) and ``_resolve_group(group)`` (which communicator to issue on).
    A subclass may use ``comm``, ``rank``, ``members``, ``view``, ``timeout``, ``peer_index()``,
    ``closed``, ``owns_comm``, ``keep_alive()``, ``retire()`` and ``share()``.
    """

    backend: ClassVar[str] = ""
    reads_failure_board: ClassVar[bool] = False
    """Wait on a helper thread and end a round as soon as a peer publishes its own error
    (``reshard_core.coordination.failures``). For backends whose waits need no calling-thread state
    (Gloo); a CUDA backend's wait orders the calling thread's stream, so NCCL waits in place."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None):
        if not isinstance(group, TransferGroup) and not (dist.is_available() and dist.is_initialized()):
            raise TransportError(f"{self.name} transport needs an initialised torch.distributed group")
        if timeout is not None and timeout <= 0:
            raise TransportError(f"{self.name} transport: timeout must be > 0 seconds, got {timeout}")
        super().__init__(group, timeout=timeout)
        self.view = view_of(group)
        self.rank = self.view.rank
        self.members = frozenset(self.view.ranks)
        if self.view.transfer is not None:  # its process groups belong to the TransferGroup, not to us
            self.comm, self._owns_comm = self.view.transfer.process_group(self.backend), False
            comm_ranks: Any = self.view.ranks  # the group's own ranks are its process group's ranks
        else:
            self.comm, self._owns_comm = self._resolve_group(group)
            comm_ranks = dist.get_process_group_ranks(self.comm) if self.comm is not None else self.view.ranks
        self._peer_index = {int(r): i for i, r in enumerate(comm_ranks)}
        self._queue: list[QueuedOp] = []
        self._closed = False

    def _resolve_group(self, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
        """The group to issue on: ``group`` itself when its backend fits, else a new one we own."""
        names = str(dist.get_backend(group)).replace(":", ",").split(",")
        if self.backend in names:
            return group, False
        return dist.new_group(ranks=sorted(self.members), backend=self.backend), True

    def peer_index(self, rank: int) -> int:
        """``rank``'s rank within ``self.comm`` (torch's ``group_dst`` / ``group_src``)."""
        return self._peer_index[rank]

    @property
    def closed(self) -> bool:
        """True after ``close()`` or ``retire()``: no op may be submitted or run."""
        return self._closed

    @property
    def owns_comm(self) -> bool:
        """True when ``comm`` was built by this transport (and ``close()`` destroys it)."""
        return self._owns_comm

    @staticmethod
    def keep_alive(obj: Any) -> None:
        """Keep ``obj`` (a given-up round, or ops or requests a backend may still write into)
        referenced for the life of the process, so no late write lands in freed memory."""
        _KEPT_ALIVE.append(obj)

    def share(self, key: str, value: bytes) -> dict[int, bytes]:
        """Publish ``value`` under ``key`` and return every member's, by rank, through the group's
        store within ``timeout`` (``rendezvous.share``): for setting a transport up without a
        collective. Every member calls it with the same ``key``, once."""
        from .rendezvous import share

        return share(self.view, key, value, self.timeout)

    def retire(self) -> None:
        """Forget ``comm`` without destroying it (a subclass aborted it) and refuse further use."""
        self.comm, self._owns_comm, self._closed = None, False, True

    # -- submission -------------------------------------------------------------------------------

    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        self._queue.append(self._checked(QueuedOp("send", tensor, int(dest_rank), int(task_id))))

    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        self._queue.append(self._checked(QueuedOp("recv", tensor, int(src_rank), int(task_id))))

    def _checked(self, op: QueuedOp) -> QueuedOp:
        what = f"{self.name}: {op.kind} with rank {op.peer} (task {op.task_id})"
        if self._closed:
            raise TransportError(f"{what}: the transport is closed")
        if not isinstance(op.tensor, torch.Tensor):
            raise TransportError(f"{what}: expected a torch.Tensor, got {type(op.tensor).__name__}")
        if op.peer == self.rank:
            raise TransportError(f"{what}: a rank cannot {op.kind} to itself; local copies are not sent")
        if op.peer not in self.members:
            raise TransportError(f"{what}: rank {op.peer} is not in the transport's group")
        if not op.tensor.is_contiguous():
            raise TransportError(f"{what}: the tensor is not contiguous")
        self._check_tensor(op, what)
        return op

    def _check_tensor(self, op: QueuedOp, what: str) -> None:
        """Raise ``TransportError`` when this transport cannot move ``op.tensor`` (device rules)."""

    # -- execution --------------------------------------------------------------------------------

    def start(self) -> InFlight:
        """Issue every queued op without waiting; the queue is empty afterwards."""
        if self._closed:
            raise TransportError(f"{self.name}: run() after close()")
        ops, self._queue = [op for op in self._queue if op.tensor.nbytes], []
        if not ops:  # zero-byte ops complete at once on both sides, without the backend
            return InFlight(self, [], [])
        try:
            issued = self._issue(ops)
        except TransportError:
            raise
        except Exception as exc:
            self.keep_alive(ops)
            reason = describe_failure(exc, self.timeout)
            raise TransportError(f"{self.name}: could not start {list_ops(ops)}: {reason}") from exc
        return InFlight(self, ops, issued)

    def run(self) -> None:
        self.start().wait()

    def _complete(self, flight: InFlight) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout

        def wait_all() -> None:
            for index, issued in enumerate(flight.issued):
                try:
                    self._wait_issued(issued, deadline)
                except Exception as exc:
                    self._fail(flight, index, exc)

        board = None
        if self.reads_failure_board and not all(_finished(item) for item in flight.issued):
            board = failures.board_for(
                self.view, lambda: f"{self.name}: {list_ops(flight.ops)}", self.timeout
            )
        if board is None:
            wait_all()  # no board to read, or done already (Gloo's P2P requests never say so)
        else:
            with watcher.watching(board, lambda: self._break(flight)) as watch:
                try:
                    wait_all()
                except Exception as exc:
                    if watch.error is not None:  # the watcher broke the wait: a peer's own failure
                        raise watch.error from exc
                    board.raise_any(exc)
                    raise
        self._finish(flight.ops)

    def _break(self, flight: InFlight) -> None:
        """From the watcher thread: make this rank's blocked wait on ``flight`` raise now (a peer's
        failure was confirmed); backends that can abort a wait from another thread override it."""

    def _fail(self, flight: InFlight, index: int, exc: BaseException) -> None:
        failed = flight.issued[index]
        pending = [item for k, item in enumerate(flight.issued) if k != index and not _finished(item)]
        others = [op for item in pending for op in item.ops]
        self.keep_alive(flight)
        try:
            self._give_up(flight, index)
        except Exception:  # giving up is best effort; the error below is what matters
            pass
        message = f"{self.name}: {list_ops(failed.ops)} failed: {describe_failure(exc, self.timeout)}"
        if others:
            message += f"; also unfinished: {list_ops(others)}"
        raise failures.blame(TransportError(message), [op.peer for op in failed.ops]) from exc

    def _issue(self, ops: list[QueuedOp]) -> list[Issued]:
        raise NotImplementedError

    def _wait_issued(self, issued: Issued, deadline: float | None) -> None:
        raise NotImplementedError

    def _finish(self, ops: list[QueuedOp]) -> None:
        """Called once after every op of a round completed."""

    def _give_up(self, flight: InFlight, failed_index: int) -> None:
        """Release peers after a failure (best effort)."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue = []
        if self._owns_comm and self.comm is not None:
            dist.destroy_process_group(self.comm)
        self.comm = None


def _finished(issued: Issued) -> bool:
    try:
        return bool(issued.work.is_completed())
    except Exception:
        return False
