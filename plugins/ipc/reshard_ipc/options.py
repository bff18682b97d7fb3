"""``IpcOptions``: what a user may set on the ``ipc`` transport, in one frozen object.

A transport named in ``refit(..., transport="ipc")`` is built without options, so each field can
also come from the environment (``IpcOptions.from_env``); an ``IpcCopyService`` built by hand takes
the object itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_FALLBACK = "RESHARD_IPC_FALLBACK"
ENV_SLOT_BYTES = "RESHARD_IPC_SLOT_BYTES"
ENV_SLOTS = "RESHARD_IPC_SLOTS"
ENV_HOST = "RESHARD_IPC_HOST"
ENV_CUDA = "RESHARD_IPC_CUDA"

MIB = 1 << 20


@dataclass(frozen=True)
class IpcOptions:
    """``fallback``: the transport for pairs on different hosts (``gloo`` or ``nccl``).
    ``slot_bytes`` and ``slots``: each channel (one per peer on this host and direction) holds
    ``slots`` chunks of ``slot_bytes``; a message of any size streams through it, so shared memory
    is ``peers × slots × slot_bytes`` per rank whatever the model. ``host``: a label added to this
    rank's host identity; ranks with different labels never share memory (to split one machine
    into several "hosts", e.g. to test the mixed case). ``cuda_ipc``: hand a CUDA send over as a
    CUDA IPC handle where the peer sees the sender's GPU (False: stage it through the ring)."""

    fallback: str = "gloo"
    slot_bytes: int = 4 * MIB
    slots: int = 4
    host: str = ""
    cuda_ipc: bool = True

    def __post_init__(self) -> None:
        if self.slot_bytes < 4096 or self.slot_bytes % 4096:
            raise ValueError(f"ipc: slot_bytes must be a positive multiple of 4096, got {self.slot_bytes}")
        if not 1 <= self.slots <= 64:
            raise ValueError(f"ipc: slots must be between 1 and 64, got {self.slots}")
        if self.fallback == "ipc":
            raise ValueError("ipc: the fallback must be another transport (gloo or nccl), not ipc")

    @property
    def channel_bytes(self) -> int:
        """Shared memory one channel takes: a header page and its slots."""
        return 4096 + self.slots * self.slot_bytes

    @classmethod
    def from_env(cls) -> IpcOptions:
        """Defaults, overridden by ``RESHARD_IPC_FALLBACK``, ``RESHARD_IPC_SLOT_BYTES``,
        ``RESHARD_IPC_SLOTS``, ``RESHARD_IPC_HOST`` and ``RESHARD_IPC_CUDA`` (0 or 1) where set."""
        env = os.environ
        return cls(
            fallback=env.get(ENV_FALLBACK, cls.fallback),
            slot_bytes=int(env.get(ENV_SLOT_BYTES, cls.slot_bytes)),
            slots=int(env.get(ENV_SLOTS, cls.slots)),
            host=env.get(ENV_HOST, cls.host),
            cuda_ipc=env.get(ENV_CUDA, "1").strip() not in ("0", "false", "no", "off"),
        )
