"""The CopyService contract every transport implements. It moves buffers and knows nothing of models."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch


class Round(Protocol):
    """A started round of a ``CopyService`` (``start()``): ``wait()`` returns once every op of it
    completed, or raises ``TransportError``."""

    def wait(self) -> None: ...


class _Done:
    """The round of a transport that completes its ops inside ``start()`` (the default)."""

    def wait(self) -> None:
        pass


class CopyService(ABC):
    """Moves submitted buffers between ranks.

    Usage per round: any number of ``submit_send`` / ``submit_recv`` calls, then one ``run()``
    that returns when every submitted op has completed (or raises ``TransportError`` naming the
    peer that failed or timed out). ``start()`` is the overlapping mode: it issues the round and
    returns a ``Round`` to ``wait()`` on later, so the caller packs the next batch meanwhile. Its
    default runs the round at once (a transport that can overlap overrides it). Two-sided
    transports pair a rank's n-th send to a peer with that peer's n-th receive from the rank
    (submission order); one-sided ones may use ``task_id``.
    Ranks are global ranks of the default world. ``close()`` releases resources; idempotent.
    """

    name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    """Where submitted tensors may live: ``"cpu"``, ``"cuda"`` or ``"any"``."""
    one_sided: ClassVar[bool] = False
    independent_rounds: ClassVar[bool] = False
    """True when a send and its matching receive may sit in different rounds on the two ranks (Gloo's
    background thread moves each op on its own). Then the executor starts every message as soon as
    it is ready. False (NCCL: stream-ordered kernels would deadlock; NVSHMEM: agrees per round with
    each peer): each batch is one round holding all of the rank's sends and receives of that batch."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when this transport can run on this machine, else a one-line reason.

        Must not import heavy dependencies at module import time; import inside this method and
        catch ``Exception``.
        """
        return None

    def __init__(
        self, group: torch.distributed.ProcessGroup | None = None, *, timeout: float | None = None
    ) -> None:
        self.group = group
        self.timeout = timeout

    @abstractmethod
    def submit_send(self, tensor: torch.Tensor, dest_rank: int, task_id: int) -> None:
        """Queue ``tensor`` (contiguous) to be sent to ``dest_rank``. Data is read during ``run()``."""

    @abstractmethod
    def submit_recv(self, tensor: torch.Tensor, src_rank: int, task_id: int) -> None:
        """Queue a receive from ``src_rank`` into ``tensor`` (contiguous), filled by ``run()``."""

    @abstractmethod
    def run(self) -> None:
        """Execute every queued op and wait for completion; the queue is empty afterwards."""

    def start(self) -> Round:
        """Issue every queued op; the returned round's ``wait()`` returns once they completed.
        Default: ``run()`` now, and a round that is already done."""
        self.run()
        return _Done()

    def close(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Release resources (buffers, streams). Safe to call more than once."""
