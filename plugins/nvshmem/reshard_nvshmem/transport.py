"""Transport ``nvshmem``: one-sided puts of packed messages into the receivers' symmetric slots.

Per ``run()``: one small handshake with each peer (``exchange.py``) fixes which piece of which
message goes into which receiver slot in which round (``schedule.py``); ``slots.py`` turns this
rank's part into stream steps; ``engine.py`` issues them on ``symmetric.py``'s CUDA streams (one
per receiver for puts, one for receiving): sends put straight from the submitted (already packed)
tensors and signal the receiver, receives wait for the signals, unpack on their own stream and
hand the slot back to the next writer. No barrier per chunk; completion is by signals.

NVSHMEM is bootstrapped when the first service of a process is built, from the service's
torch.distributed group (unique id broadcast as a uint8 tensor), and finalized when the last one
closes. Building and closing the service are therefore collective over its group (every rank
builds it, as ``refit`` does); ``run()`` involves only the peers this rank exchanges bytes with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reshard_core import TransportError
from reshard_core.transport import CopyService

from .engine import enqueue, split_messages
from .exchange import agree_run, group_rank
from .schedule import StagingConfig
from .symmetric import NvshmemRuntime, SymmetricStaging, load_nvshmem

DEFAULT_TIMEOUT_S = 300.0


class NvshmemCopyService(CopyService):
    """``CopyService`` over NVSHMEM symmetric memory (CUDA tensors only).

    Staging per rank: ``slots`` × ``slot_bytes`` of symmetric memory (default 2 × 64 MiB; also
    ``RESHARD_NVSHMEM_SLOTS`` / ``RESHARD_NVSHMEM_SLOT_BYTES``). Ops pair by submission order per
    peer, like the two-sided transports (task ids are not needed). Construction and ``close()``
    are collective over the group; ``run()`` only with the peers it moves bytes to or from.
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
        if not dist.is_initialized():
            raise TransportError(
                "NVSHMEM is not initialised: torch.distributed has no process group to bootstrap it "
                "from (call torch.distributed.init_process_group first)"
            )
        self._sends: list[tuple[torch.Tensor, int]] = []
        self._recvs: list[tuple[torch.Tensor, int]] = []
        self._nv = load_nvshmem()[0]
        try:
            NvshmemRuntime.acquire(self._nv, group)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"NVSHMEM is not initialised: bootstrap failed: {exc}") from exc
        try:
            self._staging = SymmetricStaging(self._nv, self.config, group)
        except Exception as exc:
            NvshmemRuntime.release(self._nv)
            raise TransportError(
                f"nvshmem: allocating {self.config.total_bytes} B of symmetric memory failed: {exc}"
            ) from exc
        self._me = dist.get_rank(group)
        world = group or dist.group.WORLD
        self._ranks = [dist.get_global_rank(world, g) for g in range(dist.get_world_size(group))]
        self._state = "ready"  # ready -> closed; failed (nothing in flight) or broken (streams stuck)

    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        self._sends.append((self._checked(tensor, "send to", dest_rank), self._peer(dest_rank)))

    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        self._recvs.append((self._checked(tensor, "receive from", src_rank), self._peer(src_rank)))

    def _peer(self, rank: int) -> int:
        peer = group_rank(self.group, rank)
        if peer == self._me:
            raise TransportError(f"nvshmem cannot move data from rank {rank} to itself (copy it locally)")
        return peer

    def _require_ready(self) -> None:
        if self._state == "closed":
            raise TransportError("NVSHMEM is not initialised: this nvshmem service was closed")
        if self._state != "ready":
            raise TransportError("nvshmem service is unusable after a failed run; create a new one")

    def _checked(self, tensor: torch.Tensor, what: str, peer: int) -> torch.Tensor:
        self._require_ready()
        if tensor.device != self._staging.device or not tensor.is_contiguous():
            raise TransportError(
                f"nvshmem {what} rank {peer}: needs a contiguous tensor on {self._staging.device} (the GPU "
                f"NVSHMEM runs on), got a {'' if tensor.is_contiguous() else 'non-contiguous '}"
                f"tensor on {tensor.device}"
            )
        return tensor

    def run(self) -> None:
        self.start().wait()

    def start(self) -> _Transfer:
        """Agree on the run with the peers and issue it on the streams; the returned handle's
        ``wait()`` completes it. Between the two the caller may do other work (the executor packs
        its next batch), which the puts and unpacks overlap."""
        self._require_ready()
        sends, recvs = self._sends, self._recvs
        self._sends, self._recvs = [], []
        send_map, recv_map, run = split_messages(sends, recvs)
        timeout = self.timeout or DEFAULT_TIMEOUT_S
        try:
            schedule = agree_run(run, self._me, self.group, self._ranks, self.config, timeout)
            program = self._staging.ledger.program(schedule)
        except TransportError:
            self._state = "failed"
            raise
        except Exception as exc:
            self._state = "failed"
            raise TransportError(f"nvshmem handshake failed: {exc}") from exc
        try:
            self._staging.begin()
            enqueue(program, send_map, recv_map, self._staging)
            completion = self._staging.end()  # this run's streams: the next start() forgets them
        except Exception as exc:
            raise self._broken(exc) from exc
        return _Transfer(self, timeout, completion)

    def _broken(self, exc: Exception) -> TransportError:
        """Mark the service unusable (streams may still wait on peers); the error to raise."""
        self._state = "broken"
        return TransportError(f"nvshmem run failed on rank {self._ranks[self._me]}: {exc}")

    def close(self) -> None:
        """Free this service's symmetric memory; NVSHMEM is finalized with its last service.
        Idempotent. Collective over the group, except after a run left streams waiting on peers
        (then the memory is left alone: freeing it would wait for those peers too)."""
        state, self._state = self._state, "closed"
        self._sends, self._recvs = [], []
        if state in ("ready", "failed"):
            self._staging.free()
            NvshmemRuntime.release(self._nv)


class _Transfer:
    """A started run; ``wait()`` returns when every put and unpack of it completed."""

    def __init__(self, service: NvshmemCopyService, timeout: float, completion: object):
        self._service, self._timeout, self._done = service, timeout, False
        self._completion = completion  # the staging's end() of this run

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._service._staging.finish(self._timeout, self._completion)
        except TransportError:
            self._service._state = "broken"
            raise
        except Exception as exc:
            raise self._service._broken(exc) from exc
