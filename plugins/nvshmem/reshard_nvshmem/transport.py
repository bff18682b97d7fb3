"""Transport ``nvshmem``: one-sided puts of packed messages into the receivers' symmetric slots.

Per ``run()``: the run's schedule (``schedule.py``; agreed as described in ``exchange.py``) says
which piece of which message goes into which receiver slot in which round; ``slots.py`` turns this
rank's part into stream steps; ``engine.py`` issues them on ``symmetric.py``'s two CUDA streams:
sends put straight from the submitted (already packed) tensors and signal the receiver, receives
wait for the signals, unpack on their own stream and hand the slot back to the next writer. No
barrier per chunk; completion is by signals. NVSHMEM is bootstrapped lazily at the first ``run()``
from the service's torch.distributed group (unique id broadcast as a uint8 tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch
import torch.distributed as dist

from reshard_core.errors import TransportError
from reshard_core.transport.copy_service import CopyService

from .engine import enqueue, split_messages
from .exchange import RunSchedules, group_rank
from .schedule import StagingConfig
from .symmetric import NvshmemRuntime, SymmetricStaging, load_nvshmem

DEFAULT_TIMEOUT_S = 300.0


class NvshmemCopyService(CopyService):
    """``CopyService`` over NVSHMEM symmetric memory (CUDA tensors only).

    Staging per rank: ``slots`` × ``slot_bytes`` of symmetric memory (default 2 × 64 MiB; also
    ``RESHARD_NVSHMEM_SLOTS`` / ``RESHARD_NVSHMEM_SLOT_BYTES``). Remote ops pair by submission
    order per peer, like the two-sided transports. ``run()`` and ``close()`` are collective over
    the group: every rank calls ``run()`` once per batch (also with nothing queued). Call
    ``begin_plan(key)`` on every rank before each refit of a plan to skip the per-run message
    exchange after the first refit (see ``exchange.py``).
    """

    name = "nvshmem"
    device = "cuda"
    one_sided = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return load_nvshmem()[1]

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        slot_bytes: int | None = None,
        slots: int | None = None,
    ):
        super().__init__(group, timeout=timeout)
        try:
            self.config = StagingConfig.resolve(slot_bytes, slots)
        except ValueError as exc:
            raise TransportError(f"nvshmem transport: {exc}") from None
        reason = self.unavailable_reason()
        if reason:
            raise TransportError(f"transport 'nvshmem' is unavailable: {reason}")
        self._sends: list[tuple[torch.Tensor, int]] = []
        self._recvs: list[tuple[torch.Tensor, int]] = []
        self._schedules: RunSchedules | None = None
        self._staging: SymmetricStaging | None = None
        self._plan: Hashable | None = None
        self._state = "new"  # new -> ready -> closed, or broken after a failed run

    def begin_plan(self, key: Hashable | None) -> None:
        """The following runs are the batches of one refit of plan ``key`` (same key on every rank)."""
        self._plan = key
        if self._schedules is not None:
            self._schedules.begin_plan(key)

    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        self._sends.append((self._checked(tensor, "send to", dest_rank), dest_rank))

    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        self._recvs.append((self._checked(tensor, "receive from", src_rank), src_rank))

    def _checked(self, tensor: torch.Tensor, what: str, peer: int) -> torch.Tensor:
        self._usable()
        if not (tensor.is_cuda and tensor.is_contiguous()):
            raise TransportError(
                f"nvshmem {what} rank {peer}: needs a contiguous CUDA tensor, got "
                f"{'a non-contiguous' if tensor.is_cuda else 'a ' + tensor.device.type} tensor"
            )
        return tensor

    def _usable(self) -> None:
        if self._state == "closed":
            raise TransportError("NVSHMEM is not initialised: this nvshmem service was closed")
        if self._state == "broken":
            raise TransportError("nvshmem service is unusable after a failed run; create a new one")

    def run(self) -> None:
        self._usable()
        sends, recvs = self._sends, self._recvs
        self._sends, self._recvs = [], []
        if self._state == "new":
            self._start()
        assert self._schedules is not None and self._staging is not None
        schedules, staging = self._schedules, self._staging
        me = schedules.me
        to_group = functools.partial(group_rank, self.group)
        send_map, recv_map, run = split_messages(sends, recvs, me, to_group)
        try:
            schedule = schedules.schedule_for(run)
            program = staging.ledger.program(schedule, me)
            staging.begin()
            enqueue(program, send_map, recv_map, staging)
            staging.finish(self.timeout or DEFAULT_TIMEOUT_S)
        except Exception as exc:
            self._state = "broken"
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"nvshmem run failed on rank {dist.get_rank()}: {exc}") from exc

    def _start(self) -> None:
        if not dist.is_initialized():
            raise TransportError(
                "NVSHMEM is not initialised: torch.distributed has no process group to bootstrap it "
                "from (call torch.distributed.init_process_group first)"
            )
        nv = load_nvshmem()[0]
        try:
            NvshmemRuntime.acquire(nv, self.group)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"NVSHMEM is not initialised: bootstrap failed: {exc}") from exc
        try:
            self._staging = SymmetricStaging(nv, self.config, self.group)
        except Exception as exc:
            NvshmemRuntime.release(nv)
            raise TransportError(
                f"nvshmem: allocating {self.config.total_bytes} B of symmetric memory failed: {exc}"
            ) from exc
        self._schedules = RunSchedules(self.group, self.config)
        self._schedules.begin_plan(self._plan)
        self._state = "ready"

    def close(self) -> None:
        """Free the symmetric memory and release NVSHMEM (finalized by its last user). Idempotent;
        collective over the group once the service has run."""
        state, self._state = self._state, "closed"
        self._sends, self._recvs = [], []
        if state not in ("ready", "broken") or self._staging is None:
            return
        nv, staging, self._staging = self._staging.nv, self._staging, None
        if state == "ready":  # after a timeout streams may still wait on peers: leave memory alone
            torch.cuda.synchronize()
            staging.free()
            NvshmemRuntime.release(nv)
