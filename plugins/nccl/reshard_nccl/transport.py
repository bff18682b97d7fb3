"""``NcclCopyService``: the ``nccl`` transport, batched point-to-point on a dedicated CUDA stream.

All ops of a round on one device go to NCCL in one ``batch_isend_irecv`` (so sends and receives
between a pair never deadlock), issued on the transport's side stream with the ordering rules in
``reshard_nccl.streams``. Without a ``timeout`` the round completes in stream order (no CPU wait);
with one, the CPU polls the requests until they finish or the deadline passes, and a timed-out round
aborts the communicator (a wedged NCCL communicator cannot be reused) and raises ``TransportError``.

Construction is collective over the group: it may build an NCCL group (when the given group's
backend is not NCCL) and runs one barrier so the communicator exists before the first batched P2P
(NCCL requires every rank to take part in that first call). Call ``torch.cuda.set_device`` first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reshard_core import TransportError
from reshard_core.transport import InFlight, Issued, P2PCopyService, QueuedOp, as_bytes, poll_until

from .streams import complete_on_side_stream, group_by_device, launch_on_side_stream, release_to_consumer


class NcclCopyService(P2PCopyService):
    """Batched NCCL P2P of CUDA tensors on a side stream, one batch per device per round."""

    name = "nccl"
    device = "cuda"
    one_sided = False
    backend = "nccl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if not dist.is_available():
                return "torch was built without torch.distributed"
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if not dist.is_nccl_available():
                return "torch was built without NCCL"
        except Exception as exc:  # never break plugin listing
            return f"cannot check CUDA/NCCL: {exc}"
        return None

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None):
        reason = self.unavailable_reason()
        if reason is not None:
            raise TransportError(f"nccl transport is unavailable: {reason}")
        super().__init__(group, timeout=timeout)
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        dist.barrier(group=self.comm, device_ids=[torch.cuda.current_device()])

    def _check_tensor(self, op: QueuedOp, what: str) -> None:
        if not op.tensor.is_cuda:
            raise TransportError(f"{what}: nccl moves CUDA tensors only, got one on {op.tensor.device}")

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        return self._side[device]

    def _issue(self, ops: list[QueuedOp]) -> list[Issued]:
        issued: list[Issued] = []
        for device, group in group_by_device(ops, lambda op: op.tensor.device).items():
            for op in group:
                op.wire = as_bytes(op.tensor)
            requests = launch_on_side_stream(
                self._side_stream(device),
                torch.cuda.current_stream(device),
                [op.tensor for op in group],
                lambda group=group: dist.batch_isend_irecv([self._p2p_op(op) for op in group]),
                torch.cuda.stream,
            )
            if len(requests) == len(group):
                issued += [Issued(work, [op]) for work, op in zip(requests, group, strict=True)]
            else:  # a coalesced batch may come back as one request covering every op
                issued += [Issued(work, list(group)) for work in requests]
        return issued

    def _p2p_op(self, op: QueuedOp) -> dist.P2POp:
        start = dist.isend if op.kind == "send" else dist.irecv
        return dist.P2POp(start, op.wire, group=self.comm, group_peer=self.peer_index(op.peer))

    def _wait_issued(self, issued: Issued, deadline: float | None) -> None:
        if deadline is not None:
            poll_until(issued.work.is_completed, deadline)
        side = self._side_stream(issued.ops[0].tensor.device)
        complete_on_side_stream(side, issued.work.wait, torch.cuda.stream)

    def _finish(self, ops: list[QueuedOp]) -> None:
        for device in {op.tensor.device for op in ops}:
            release_to_consumer(self._side_stream(device), torch.cuda.current_stream(device))

    def _resolve_group(self, group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, bool]:
        """Always a communicator of our own over the group's ranks (made by those ranks only), so a
        failure can abort it alone: aborting the caller's group, and above all the default group
        (``_abort_process_group(None)`` aborts every process group of the job), would take the
        application's communicators down with ours."""
        return dist.new_group(
            ranks=sorted(self.members), backend="nccl", use_local_synchronization=True
        ), True

    def _give_up(self, flight: InFlight, failed_index: int) -> None:
        """Abort our own communicator (never None, never one we do not own), then refuse further use."""
        if self.owns_comm and self.comm is not None:
            dist.distributed_c10d._abort_process_group(self.comm)
        self.retire()

    def close(self) -> None:
        super().close()
        self._side.clear()
