"""Run a Megatron-Core ``CopyService`` instance as a reshard transport.

Megatron's services (``megatron.core.resharding.copy_services``) take ``submit_send(tensor,
dest_rank[, task_id])``, ``submit_recv(tensor, src_rank[, task_id])`` and ``run()``; 0.16.1's base
class has no ``task_id`` parameter, newer ones do. Newer services address peers by their rank in the
service's own ``group`` (``group_peer``), older ones by global rank. ``MegatronServiceAdapter``
translates reshard's calls (global ranks, one ``run()`` per batch, a ``task_id`` always) to that
convention. It owns nothing: ``close()`` leaves the wrapped service open (its creator closes it).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from ..transport.copy_service import CopyService


def is_copy_service_like(obj: Any) -> bool:
    """True for an object with Megatron's CopyService methods (``submit_send``, ``submit_recv``, ``run``)."""
    return all(callable(getattr(obj, m, None)) for m in ("submit_send", "submit_recv", "run"))


def _takes_task_id(method: Any) -> bool:
    """Whether ``method`` accepts a third positional argument or a ``task_id`` keyword."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params) or any(p.name == "task_id" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


class MegatronServiceAdapter(CopyService):
    """A reshard ``CopyService`` that forwards every op to a Megatron ``CopyService`` instance.

    Two-sided, one round per batch (``run()`` per batch), tensors anywhere (``device = "any"``): the
    wrapped service decides where it can move them. Ranks: reshard passes global ranks; when the
    service has a ``group`` (newer Megatron), they are translated to ranks in that group.
    """

    one_sided = False
    independent_rounds = False
    device = "any"

    def __init__(self, service: Any, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group)
        self.service = service
        self.name = f"megatron:{type(service).__name__}"
        self._send_task_id = _takes_task_id(service.submit_send)
        self._recv_task_id = _takes_task_id(service.submit_recv)
        self._service_group = getattr(service, "group", None)

    def _peer(self, rank: int) -> int:
        if self._service_group is None:
            return rank
        return dist.get_group_rank(self._service_group, rank)

    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        if self._send_task_id:
            self.service.submit_send(tensor, self._peer(dest_rank), task_id)
        else:
            self.service.submit_send(tensor, self._peer(dest_rank))

    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        if self._recv_task_id:
            self.service.submit_recv(tensor, self._peer(src_rank), task_id)
        else:
            self.service.submit_recv(tensor, self._peer(src_rank))

    def run(self) -> None:
        self.service.run()

    def close(self) -> None:
        """Leave the wrapped service open: whoever created it closes it."""
