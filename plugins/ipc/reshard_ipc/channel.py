"""One direction between two ranks: a ring of slots inside the sender's segment.

Layout (from the channel's offset): a 4096-byte header of int64 words, then ``slots`` slots of
``slot_bytes``. Each word has one writer:

- word 0, ``published``: chunks the sender has written (sender);
- word 8, ``consumed``: chunks the receiver has copied out (receiver);
- word 16, the sender's state and word 24 the receiver's (``OPEN``, ``GAVE_UP``, ``CLOSED``): a side
  that stops mid-stream says so, and the other fails at once instead of waiting out its timeout;
- words 32 + 2i and 33 + 2i: the length and task id (its low 63 bits) of the chunk in slot i; a
  negative length marks a handle (``cuda_ipc``) of ``-length`` bytes instead of data: the receiver
  copies the whole message from the sender's GPU memory, and ``consumed`` passing the handle's slot
  tells the sender the copy is done.

The sender writes a chunk, its length and task, then bumps ``published``; the receiver reads
``published``, copies the chunk out, then bumps ``consumed``. Separate cache lines keep the two
writers apart. The order of these plain stores and loads is what x86-64 guarantees (TSO), and
``IpcCopyService.unavailable_reason`` refuses other architectures.
"""

from __future__ import annotations

import torch

from .segment import Segment

HEADER_BYTES = 4096
OPEN, GAVE_UP, CLOSED = 0, 1, 2
_PUBLISHED, _CONSUMED, _SENDER, _RECEIVER, _SLOTS = 0, 8, 16, 24, 32
TASK_MASK = (1 << 63) - 1
"""A chunk records its task id's low 63 bits (ids are any int; they only name chunks in errors)."""


class Channel:
    """The ring at ``offset`` of ``segment``, seen from one side (``sending`` or not)."""

    def __init__(self, segment: Segment, offset: int, slots: int, slot_bytes: int, *, sending: bool) -> None:
        self.segment, self.slots, self.slot_bytes, self.sending = segment, slots, slot_bytes, sending
        self._base = offset // 8
        start = offset + HEADER_BYTES
        self._slot = [
            segment.data[start + i * slot_bytes : start + (i + 1) * slot_bytes] for i in range(slots)
        ]
        self.count = 0  # chunks this side has published (sender) or consumed (receiver)

    def _word(self, index: int) -> int:
        return self.segment.words[self._base + index]

    def _set(self, index: int, value: int) -> None:
        self.segment.words[self._base + index] = value

    # -- sender -----------------------------------------------------------------------------------

    def free(self) -> int:
        """Slots the sender may fill now."""
        return self.slots - (self.count - self._word(_CONSUMED))

    def put(self, chunk: torch.Tensor, task: int) -> None:
        """Write ``chunk`` (flat uint8, at most ``slot_bytes``) into the next slot and publish it."""
        slot = self.count % self.slots
        self._slot[slot][: chunk.numel()].copy_(chunk)
        self._set(_SLOTS + 2 * slot, chunk.numel())
        self._set(_SLOTS + 2 * slot + 1, task & TASK_MASK)
        self.count += 1
        self._set(_PUBLISHED, self.count)

    def put_handle(self, blob: bytes, task: int) -> int:
        """Publish a CUDA IPC handle in the next slot; returns the count ``consumed`` must reach
        before the sender's memory may be reused."""
        slot = self.count % self.slots
        self._slot[slot][: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self._set(_SLOTS + 2 * slot, -len(blob))
        self._set(_SLOTS + 2 * slot + 1, task & TASK_MASK)
        self.count += 1
        self._set(_PUBLISHED, self.count)
        return self.count

    def consumed(self) -> int:
        """Chunks the receiver has copied out."""
        return self._word(_CONSUMED)

    # -- receiver ---------------------------------------------------------------------------------

    def ready(self) -> int:
        """Chunks published and not yet copied out."""
        return self._word(_PUBLISHED) - self.count

    def head(self) -> tuple[int, int]:
        """``(length, task)`` of the next chunk to copy out."""
        slot = self.count % self.slots
        return self._word(_SLOTS + 2 * slot), self._word(_SLOTS + 2 * slot + 1)

    def read_handle(self, size: int) -> bytes:
        """The handle in the next slot (``size`` bytes); ``skip()`` once its copy is done."""
        return self._slot[self.count % self.slots][:size].numpy().tobytes()

    def skip(self) -> None:
        """Free the next slot without copying it out (a handle whose copy is done)."""
        self.count += 1
        self._set(_CONSUMED, self.count)

    def take(self, out: torch.Tensor) -> None:
        """Copy the next chunk into ``out`` (flat uint8 of the chunk's length) and free its slot."""
        slot = self.count % self.slots
        out.copy_(self._slot[slot][: out.numel()])
        self.count += 1
        self._set(_CONSUMED, self.count)

    # -- states -----------------------------------------------------------------------------------

    def say(self, state: int) -> None:
        """Tell the other side this side's state (``GAVE_UP`` or ``CLOSED``)."""
        self._set(_SENDER if self.sending else _RECEIVER, state)

    def other_state(self) -> int:
        """The other side's state."""
        return self._word(_RECEIVER if self.sending else _SENDER)

    def release(self) -> None:
        """Drop the views of the segment (so it can be unmapped)."""
        self._slot = []
