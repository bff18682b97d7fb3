"""A CPU stand-in for ``SymmetricStaging``, so ``NvshmemCopyService`` runs end to end in a Gloo world.

The "symmetric heap" is two CPU tensors shared by every rank's process (slots ``[world, slots,
slot_bytes]`` and signal words ``[world, slots + world]``): made in shared memory before the world
is spawned, or mapped from files named by ``HEAP_ENV`` (for worlds spawned by others, such as the
conformance suite). Each stream is a worker thread running its operations in order; a wait spins on
a shared word, a put copies into the peer's slot and then adds to the peer's word under a lock.
Completion is per stream, as with CUDA events: ``end()`` marks how far the run's streams (the receive
stream and the send streams it used since ``begin()``) must get, and ``finish`` waits for those marks
only; ``put_gate`` holds puts to a peer back, to open the window a missed stream leaves.
Only the NVSHMEM calls are emulated: the transport, handshake, layouts, ledger and engine are the
real ones.
"""

from __future__ import annotations

import fcntl
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from reshard_nvshmem.schedule import StagingConfig
from reshard_nvshmem.slots import SignalLedger

from reshard_core.errors import TransportError

HEAP_ENV = "RESHARD_NVSHMEM_TEST_HEAP"
MAX_WORLD = 4


class _Stream:
    """Runs submitted callables in order on a daemon thread; ``done`` counts the finished ones."""

    def __init__(self) -> None:
        self.ops: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.submitted = self.done = 0
        self.progress = threading.Condition()
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, op: Callable[[], None]) -> None:
        self.submitted += 1
        self.ops.put(op)

    def reached(self, mark: int, timeout: float) -> bool:
        """Wait until ``mark`` operations finished (an event recorded after them completed)."""
        with self.progress:
            return self.progress.wait_for(lambda: self.done >= mark, timeout)

    def _loop(self) -> None:
        while (op := self.ops.get()) is not None:
            try:
                op()
            except BaseException as exc:  # surfaced by finish()
                self.error = exc
            with self.progress:
                self.done += 1
                self.progress.notify_all()


class EmulatedStaging:
    """``StreamOps`` + run boundaries of ``SymmetricStaging`` over shared CPU memory."""

    device = torch.device("cpu")

    def __init__(self, slots: torch.Tensor, signals: torch.Tensor, lock, me: int, config: StagingConfig):
        self.heap, self.signals, self.lock, self.me, self.config = slots, signals, lock, me, config
        self.ledger = SignalLedger(config.slots)
        self._streams: dict[object, _Stream] = {}
        self._active: list[object] = []  # send streams used since begin(), like SymmetricStaging's
        self._stop = False
        self.put_gate: dict[int, threading.Event] = {}  # peer -> puts to it wait for this before copying

    def _stream(self, key: object) -> _Stream:
        if key not in self._streams:
            self._streams[key] = _Stream()
        if key != "recv" and key not in self._active:
            self._active.append(key)
        return self._streams[key]

    def _add(self, rank: int, word: int) -> None:
        with self.lock:
            self.signals[rank, word] += 1

    def reset(self, group) -> None:
        """What a fresh allocation gives: this rank's words at zero before any peer signals."""
        self.signals[self.me].zero_()
        dist.barrier(group=group)

    def _spin(self, word: int, value: int) -> None:
        while int(self.signals[self.me, word]) < value and not self._stop:
            time.sleep(0.0001)

    def grant(self, peer: int) -> None:
        self._stream("recv").submit(lambda: self._add(peer, self.config.slots + self.me))

    def wait_credit(self, peer: int, value: int) -> None:
        self._stream(peer).submit(lambda: self._spin(self.config.slots + peer, value))

    def put(self, peer: int, src: torch.Tensor, slot: int, offset: int) -> None:
        gate = self.put_gate.get(peer)

        def op() -> None:
            if gate is not None:
                gate.wait()
            self.heap[peer, slot, offset : offset + src.numel()].copy_(src)
            self._add(peer, slot)

        self._stream(peer).submit(op)

    def wait_arrival(self, slot: int, value: int) -> None:
        self._stream("recv").submit(lambda: self._spin(slot, value))

    def unpack(self, slot: int, pieces: Sequence[tuple[torch.Tensor, int]]) -> None:
        def op() -> None:
            for dst, offset in pieces:
                dst.copy_(self.heap[self.me, slot, offset : offset + dst.numel()])

        self._stream("recv").submit(op)

    def begin(self) -> None:
        self._active = []

    def end(self) -> dict[object, int]:
        """The run's completion marks: how many operations each of its streams must have finished."""
        return {key: self._stream(key).submitted for key in ("recv", *self._active)}

    def finish(self, timeout: float, marks: dict[object, int] | None = None) -> None:
        """Return once the streams reached ``marks`` (None: where the streams used since ``begin()``
        stand now, which is all an event recorded at this point would cover)."""
        marks = self.end() if marks is None else marks
        deadline = time.monotonic() + timeout
        for key, mark in marks.items():
            stream = self._streams[key]
            if not stream.reached(mark, max(deadline - time.monotonic(), 0)):
                raise TransportError(f"nvshmem run timed out after {timeout:.0f} s (emulated)")
            if stream.error is not None:
                raise stream.error

    def free(self) -> None:
        self._stop = True
        for stream in self._streams.values():
            stream.ops.put(None)


def shared_heap(world: int, config: StagingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulated symmetric heap, in shared memory (pass it to the spawned ranks)."""
    slots = torch.zeros(world, config.slots, config.slot_bytes, dtype=torch.uint8).share_memory_()
    signals = torch.zeros(world, config.slots + world, dtype=torch.int64).share_memory_()
    return slots, signals


class _FileLock:
    """A lock across processes (``flock`` on a file) and across this process's stream threads."""

    def __init__(self, path: Path):
        self.path, self.local = path, threading.Lock()

    def __enter__(self) -> None:
        self.local.acquire()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.local.release()


def file_heap(folder: Path, config: StagingConfig) -> None:
    """Create the heap files for worlds of up to ``MAX_WORLD`` ranks in ``folder``."""
    (folder / "config").write_text(f"{config.slot_bytes} {config.slots}")
    (folder / "slots").write_bytes(bytes(MAX_WORLD * config.slots * config.slot_bytes))
    (folder / "signals").write_bytes(bytes(8 * MAX_WORLD * (config.slots + MAX_WORLD)))


def _mapped(folder: Path, world: int) -> tuple[torch.Tensor, torch.Tensor, StagingConfig]:
    slot_bytes, slots = map(int, (folder / "config").read_text().split())
    config = StagingConfig(slot_bytes=slot_bytes, slots=slots)
    size = MAX_WORLD * slots * slot_bytes
    heap = torch.from_file(str(folder / "slots"), shared=True, size=size, dtype=torch.uint8)
    words = MAX_WORLD * (slots + MAX_WORLD)
    signals = torch.from_file(str(folder / "signals"), shared=True, size=words, dtype=torch.int64)
    signals = signals.view(MAX_WORLD, slots + MAX_WORLD)[:world, : slots + world]
    return heap.view(MAX_WORLD, slots, slot_bytes)[:world], signals, config


def _emulated_transport_module():
    """``reshard_nvshmem.transport`` with NVSHMEM replaced by the file-mapped emulated heap."""
    from reshard_nvshmem import transport

    def staging(nv, config, group):
        folder = Path(os.environ[HEAP_ENV])
        heap, signals, heap_config = _mapped(folder, dist.get_world_size(group))
        if (heap_config.slot_bytes, heap_config.slots) != (config.slot_bytes, config.slots):
            raise ValueError(f"the test heap was made for {heap_config}, not {config}")
        emulated = EmulatedStaging(heap, signals, _FileLock(folder / "lock"), dist.get_rank(group), config)
        emulated.reset(group)
        return emulated

    transport.load_nvshmem = lambda: (object(), None)
    transport.NvshmemRuntime.acquire = classmethod(lambda cls, nv, group: None)
    transport.NvshmemRuntime.release = classmethod(lambda cls, nv: None)
    transport.SymmetricStaging = staging
    return transport


class EmulatedNvshmemCopyService:
    """Builds the real ``NvshmemCopyService`` over the emulated heap (for the conformance suite)."""

    def __new__(cls, group=None, **kwargs):
        transport = _emulated_transport_module()

        class Emulated(transport.NvshmemCopyService):
            @classmethod
            def unavailable_reason(cls) -> None:
                return None

        return Emulated(group, **kwargs)
