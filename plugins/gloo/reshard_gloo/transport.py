"""``GlooCopyService``: the ``gloo`` transport over torch.distributed Gloo point-to-point ops.

CPU tensors go on the wire as they are (as raw bytes). CUDA tensors are staged through pinned host
memory: receives land on the host and are copied back to the device (on the caller's current stream)
when the round completes; sends are copied to the host asynchronously and go on the wire together at
the next flush (the next round that is not only device sends, the first wait, or close), after ONE
synchronization of the devices' current streams. The executor starts every message as its own round
(``independent_rounds``), so syncing in each round would block the host once per message. Sends keep
their order per peer (a flush precedes any other op). Needs no CUDA unless CUDA tensors are submitted.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from reshard_core.transport import InFlight, Issued, P2PCopyService, QueuedOp, as_bytes, remaining


class GlooCopyService(P2PCopyService):
    """Point-to-point over Gloo, one request per submitted op, waited with the service's timeout."""

    name = "gloo"
    device = "any"
    one_sided = False
    independent_rounds = True
    backend = "gloo"
    reads_failure_board = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if not dist.is_available():
                return "torch was built without torch.distributed"
            if not dist.is_gloo_available():
                return "torch was built without Gloo"
        except Exception as exc:  # never break plugin listing
            return f"cannot check Gloo: {exc}"
        return None

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None):
        super().__init__(group, timeout=timeout)
        self._deferred: list[_DeferredSend] = []  # device sends staged, not yet on the wire

    def _issue(self, ops: list[QueuedOp]) -> list[Issued]:
        staged = _stage_to_host(ops)
        if len(staged) == len(ops) and all(op.kind == "send" for op in ops):
            deferred = [_DeferredSend(self, op) for op in ops]
            self._deferred += deferred
            return [Issued(d, [d.op]) for d in deferred]
        self.flush()
        for device in dict.fromkeys(as_bytes(op.tensor).device for op in staged if op.kind == "send"):
            _sync_stream(device)  # a mixed round: its own host copies, one sync per device
        issued: list[Issued] = []
        try:
            for op in ops:
                peer = self.peer_index(op.peer)
                if op.kind == "send":
                    work = dist.isend(op.wire, group=self.comm, group_dst=peer)
                else:
                    work = dist.irecv(op.wire, group=self.comm, group_src=peer)
                issued.append(Issued(work, [op]))
        except Exception:
            self.keep_alive(issued)  # requests already started may still touch their buffers
            raise
        return issued

    def flush(self) -> None:
        """Put the staged device sends on the wire, in order, after one sync of the devices they came from."""
        deferred, self._deferred = self._deferred, []
        if not deferred:
            return
        for device in dict.fromkeys(d.device for d in deferred):  # host copies complete before Gloo reads
            _sync_stream(device)
        for d in deferred:
            try:
                d.work = dist.isend(d.op.wire, group=self.comm, group_dst=self.peer_index(d.op.peer))
            except Exception as exc:  # raised by this send's wait()
                d.error = exc

    def close(self) -> None:
        if not self.closed:
            try:
                self.flush()  # a peer may be waiting for them
            except Exception:  # best effort: closing must not fail
                pass
            super().close()

    def _wait_issued(self, issued: Issued, deadline: float | None) -> None:
        self.flush()  # never block while our own sends are held back: the peer may wait for them
        left = remaining(deadline)
        if left is None:
            issued.work.wait()
        else:
            # Gloo reads a zero timeout as "use the group default", so ``remaining`` never returns 0.
            issued.work.wait(datetime.timedelta(seconds=left))

    def _finish(self, ops: list[QueuedOp]) -> None:
        for op in ops:
            if op.kind == "recv" and _on_device(op.tensor):
                as_bytes(op.tensor).copy_(op.wire, non_blocking=True)

    def _give_up(self, flight: InFlight, failed_index: int) -> None:
        # A Gloo wait that times out closes its pair, so the peer's pending op fails at once.
        self.flush()
        for item in flight.issued[failed_index + 1 :]:
            try:
                item.work.wait(datetime.timedelta(milliseconds=1))
            except Exception:
                pass

    def _break(self, flight: InFlight) -> None:
        # From the watcher thread: a 1 ms wait on a request already on the wire times out, which
        # closes this rank's Gloo pairs, so the wait blocked on the calling thread raises at once.
        for item in flight.issued:
            work = item.work.work if isinstance(item.work, _DeferredSend) else item.work
            if work is not None:
                try:
                    work.wait(datetime.timedelta(milliseconds=1))
                except Exception:
                    pass
                return


class _DeferredSend:
    """The request of a staged device send: ``work`` once flushed (a wait flushes first)."""

    def __init__(self, service: GlooCopyService, op: QueuedOp) -> None:
        self.service, self.op, self.device = service, op, as_bytes(op.tensor).device
        self.work: Any = None
        self.error: Exception | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.work is None and self.error is None:
            self.service.flush()
        if self.error is not None:
            raise self.error
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work is not None and bool(self.work.is_completed())


def _on_device(data: torch.Tensor) -> bool:
    """Whether ``data`` must be staged through host memory (CUDA)."""
    return data.is_cuda


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _sync_stream(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def _stage_to_host(ops: list[QueuedOp]) -> list[QueuedOp]:
    """Set ``op.wire``: the CPU bytes Gloo moves (pinned host copies for CUDA tensors, sends copied
    asynchronously: synchronize before Gloo reads them). Returns the staged ops."""
    staged = []
    for op in ops:
        data = as_bytes(op.tensor)
        if not _on_device(data):
            op.wire = data
            continue
        op.wire = _host_buffer(data.numel())
        if op.kind == "send":
            op.wire.copy_(data, non_blocking=True)
        staged.append(op)
    return staged
