"""``GlooCopyService``: the ``gloo`` transport over torch.distributed Gloo point-to-point ops.

CPU tensors go on the wire as they are (as raw bytes). CUDA tensors are staged through pinned host
memory: sends are copied to the host before the round starts, receives land on the host and are
copied back to the device (on the caller's current stream) when the round completes. Needs no CUDA
unless CUDA tensors are submitted.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from reshard_core.transport.p2p import (
    _ABANDONED,
    InFlight,
    Issued,
    P2PCopyService,
    QueuedOp,
    as_bytes,
    remaining,
)


class GlooCopyService(P2PCopyService):
    """Point-to-point over Gloo, one request per submitted op, waited with the service's timeout."""

    name = "gloo"
    device = "any"
    one_sided = False
    independent_rounds = True
    backend = "gloo"

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

    def _issue(self, ops: list[QueuedOp]) -> list[Issued]:
        _stage_to_host(ops)
        issued: list[Issued] = []
        try:
            for op in ops:
                start = dist.isend if op.kind == "send" else dist.irecv
                issued.append(Issued(start(op.wire, op.peer, group=self.comm), [op]))
        except Exception:
            _ABANDONED.append(issued)  # requests already started may still touch their buffers
            raise
        return issued

    def _wait_issued(self, issued: Issued, deadline: float | None) -> None:
        left = remaining(deadline)
        if left is None:
            issued.work.wait()
        else:
            # Gloo reads a zero timeout as "use the group default", so ``remaining`` never returns 0.
            issued.work.wait(datetime.timedelta(seconds=left))

    def _finish(self, ops: list[QueuedOp]) -> None:
        for op in ops:
            if op.kind == "recv" and op.tensor.is_cuda:
                as_bytes(op.tensor).copy_(op.wire, non_blocking=True)

    def _give_up(self, flight: InFlight, failed_index: int) -> None:
        # A Gloo wait that times out closes its pair, so the peer's pending op fails at once.
        for item in flight.issued[failed_index + 1 :]:
            try:
                item.work.wait(datetime.timedelta(milliseconds=1))
            except Exception:
                pass


def _stage_to_host(ops: list[QueuedOp]) -> None:
    """Set ``op.wire``: the CPU bytes Gloo moves (pinned host copies for CUDA tensors)."""
    devices = set()
    for op in ops:
        data = as_bytes(op.tensor)
        if not data.is_cuda:
            op.wire = data
            continue
        op.wire = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        if op.kind == "send":
            op.wire.copy_(data, non_blocking=True)
            devices.add(data.device)
    for device in devices:  # the host copies must be complete before Gloo reads them
        torch.cuda.current_stream(device).synchronize()
