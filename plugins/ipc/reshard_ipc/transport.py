"""``IpcCopyService``: the ``ipc`` transport. Peers on this host through shared memory, the others
through a fallback transport, within one round.

Set-up (``hosts.connect``) is collective over the group's members, through its store; it decides
which peers share memory with this rank. In a round, ops with those peers are posted to the pump
(``pump.py``), the others to the fallback transport (``IpcOptions.fallback``, built over the same
group), and one ``InFlight`` waits for both. The plan never changes: only the path of each pair.

Failures follow ``P2PCopyService``: a round not done within ``timeout`` raises ``TransportError``
naming the op; a peer that said it gave up or closed, or whose process is gone, fails its ops at
once with that reason; a peer's published error ends the wait early (``reads_failure_board``).
Giving up on a round tells the shared-memory peers, whose waits then fail at once.

A CUDA send to a peer that sees the sender's GPU is handed over as a CUDA IPC handle to the sender's
own memory (``cuda_ipc``): the receiver copies it out in one device copy, and the send completes once
it did. Other CUDA tensors are staged through the host segments (a device-to-host copy on send, one
host-to-device copy on receive).
"""

from __future__ import annotations

import itertools
import platform
from typing import Any

import torch
import torch.distributed as dist

from reshard_core import TransportError, get_transport
from reshard_core.transport import InFlight, Issued, P2PCopyService, QueuedOp, as_bytes, remaining

from .hosts import Link, connect
from .options import IpcOptions
from .pump import Pump, Transfer

_serials: dict[Any, itertools.count] = {}


class IpcCopyService(P2PCopyService):
    """Shared memory with the peers of this host, ``options.fallback`` with the others."""

    name = "ipc"
    device = "any"
    one_sided = False
    independent_rounds = True
    backend = "gloo"
    reads_failure_board = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return f"its shared-memory counters rely on x86-64 memory ordering; this is {platform.machine()}"
        try:
            import _posixshmem  # noqa: F401
        except Exception as exc:
            return f"POSIX shared memory is not available: {exc}"
        if not (dist.is_available() and dist.is_gloo_available()):
            return "torch was built without torch.distributed Gloo (the default fallback)"
        return None

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None,
        options: IpcOptions | None = None,
    ) -> None:  # fmt: skip
        super().__init__(group, timeout=timeout)
        self.options = options if options is not None else IpcOptions.from_env()
        self.fallback = get_transport(self.options.fallback)(group, timeout=timeout)
        serial = next(_serials.setdefault(self.view.key, itertools.count()))
        try:
            self.link: Link = connect(self, serial, self.options)
        except BaseException:
            self.fallback.close()
            raise
        self.near = frozenset(self.link.peers)
        """Peers reached through shared memory; every other member goes through ``fallback``."""
        self.refused = dict(self.link.refused)
        """Peers reporting this host that could not share memory with this rank, and why."""
        self._pump = Pump(self.rank, self.link.peers, self.link.gpus) if self.link.peers else None

    def _resolve_group(self, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
        return group, False  # set-up goes through the store and remote pairs through the fallback

    def routes(self) -> dict[str, list[int]]:
        """Peers by path: ``{"ipc": [...], "<fallback>": [...]}`` (set-up's verdict)."""
        others = sorted(self.members - self.near - {self.rank})
        return {"ipc": sorted(self.near), self.options.fallback: others}

    def _check_tensor(self, op: QueuedOp, what: str) -> None:
        if op.peer not in self.near:
            return
        if op.tensor.device.type not in ("cpu", "cuda"):
            raise TransportError(f"{what}: ipc moves CPU and CUDA tensors, not {op.tensor.device.type}")

    def _issue(self, ops: list[QueuedOp]) -> list[Issued]:
        issued: list[Issued] = []
        remote = [op for op in ops if op.peer not in self.near]
        if remote:
            for op in remote:
                submit = self.fallback.submit_send if op.kind == "send" else self.fallback.submit_recv
                submit(op.tensor, op.peer, op.task_id)
            issued.append(Issued(_Remote(self.fallback.start()), remote))
        near = [op for op in ops if op.peer in self.near]
        if near:
            transfers = [self._transfer(op) for op in near]
            self._pump.post(transfers)
            issued.append(Issued(_Near(transfers, near), near))
        return issued

    def _transfer(self, op: QueuedOp) -> Transfer:
        """What the pump moves for ``op``: a CUDA IPC handle for a CUDA send whose peer sees its GPU;
        else the host bytes the ring carries (a receive may still land a handle in place)."""
        data = as_bytes(op.tensor)
        gpus = self.link.gpus
        seen = self.link.peers[op.peer].gpus
        if op.kind == "send" and data.is_cuda and gpus and gpus[data.device.index] in seen:
            from .cuda_ipc import export

            op.wire = data
            return Transfer("send", data, op.peer, op.task_id, handle=export(data, gpus))
        host = _host_side(op)
        landed = (lambda: setattr(op, "wire", None)) if op.kind == "recv" else None
        return Transfer(op.kind, host, op.peer, op.task_id, target=data, landed=landed)

    def _wait_issued(self, issued: Issued, deadline: float | None) -> None:
        issued.work.wait(deadline)

    def _finish(self, ops: list[QueuedOp]) -> None:
        for op in ops:  # a CUDA receive staged through the ring: its host bytes go to the device
            if op.kind == "recv" and op.peer in self.near and op.wire is not None and op.tensor.is_cuda:
                as_bytes(op.tensor).copy_(op.wire)

    def _give_up(self, flight: InFlight, failed_index: int) -> None:
        self._break_near(flight, f"rank {self.rank} gave up on the round")
        for item in flight.issued:
            if isinstance(item.work, _Remote):
                item.work.flight.abandon()

    def _break(self, flight: InFlight) -> None:
        self._break_near(flight, "a peer's failure ended the round")

    def _break_near(self, flight: InFlight, reason: str) -> None:
        """Break the pipes of ``flight``'s unfinished shared-memory transfers, telling those peers."""
        peers = {t.peer for item in flight.issued if isinstance(item.work, _Near) for t in item.work.transfers
                 if not t.done.is_set()}  # fmt: skip
        if peers:
            self._pump.break_pipes(peers, reason)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self._pump is not None:
            self._pump.close()
        for segment in self.link.segments:
            segment.close()
        self.fallback.close()


class _Near:
    """The shared-memory part of a round: done when every transfer is."""

    def __init__(self, transfers: list[Transfer], ops: list[QueuedOp]) -> None:
        self.transfers, self.ops = transfers, ops

    def wait(self, deadline: float | None) -> None:
        for t in self.transfers:
            if not t.done.wait(remaining(deadline)):
                raise TimeoutError("timed out")
            if t.error is not None:
                raise t.error

    def is_completed(self) -> bool:
        return all(t.done.is_set() and t.error is None for t in self.transfers)


class _Remote:
    """The fallback transport's part of a round."""

    def __init__(self, flight: Any) -> None:
        self.flight = flight

    def wait(self, deadline: float | None) -> None:
        self.flight.wait()  # bounded by the fallback's own timeout, the same as ours

    def is_completed(self) -> bool:
        return bool(self.flight.done)


def _host_side(op: QueuedOp) -> torch.Tensor:
    """The flat host bytes the pump moves for ``op`` (``op.wire``): the tensor itself on the CPU; a
    host copy for a CUDA tensor (a send's taken now, a receive's copied back by ``_finish``)."""
    data = as_bytes(op.tensor)
    if data.device.type == "cpu":
        op.wire = data
    elif op.kind == "send":
        op.wire = data.to("cpu")
    else:
        op.wire = torch.empty(data.numel(), dtype=torch.uint8)
    return op.wire
