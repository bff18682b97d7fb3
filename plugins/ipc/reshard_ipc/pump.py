"""``Pump``: the thread that streams posted sends and receives through the channels.

A posted op is a ``Transfer``. Per peer and direction, transfers go in posting order (the n-th send
to a peer pairs with that peer's n-th receive from us), each cut into chunks of at most a slot. The
thread moves every pipe as far as it can (a send while the peer's ring has free slots, a receive
while chunks are waiting), then sleeps briefly when nothing moved, so the calling thread may pack,
copy or wait on another transport meanwhile and no rank waits for another to call in.

A pipe breaks for good (its stream is cut mid-message) when: the peer said it gave up or closed, the
peer's process is gone, a chunk's length is not the one this side expects, or the transport gave up
on a round (``give_up``). Every transfer with that peer then fails with the reason, and so does any
later one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard_core import TransportError

from .channel import CLOSED, GAVE_UP, OPEN, TASK_MASK
from .hosts import Peer
from .segment import alive

LIVENESS_SECONDS = 0.2
"""How often a pipe that is not moving checks that its peer still runs."""


@dataclass(eq=False)
class Transfer:
    """One posted send or receive of ``data`` (flat uint8, host bytes the ring carries) with
    ``peer``. A send with a ``handle`` hands the sender's GPU memory over instead (``cuda_ipc``);
    a receive lands such a handle's bytes straight in ``target`` (the op's own bytes, on its device)
    and calls ``landed`` (nothing is left to copy from ``data``)."""

    kind: str
    data: torch.Tensor
    peer: int
    task: int
    handle: bytes | None = None
    target: torch.Tensor | None = None
    landed: Callable[[], None] | None = None
    moved: int = 0
    ack_at: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()


class Pump:
    """Moves the transfers of ``peers`` (by rank) on a daemon thread until ``close()``."""

    def __init__(self, rank: int, peers: dict[int, Peer], gpus: tuple[str, ...] = ()) -> None:
        self.rank = rank
        self.peers = peers
        self.gpus = gpus  # this process's GPUs by index (``cuda_ipc.visible_gpus``)
        self._queues: dict[tuple[int, str], deque[Transfer]] = {
            (p, kind): deque() for p in peers for kind in ("send", "recv")
        }
        self._broken: dict[int, str] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"reshard-ipc-pump-{rank}", daemon=True)
        self._thread.start()

    def post(self, transfers: list[Transfer]) -> None:
        """Queue ``transfers`` (each after those already queued with its peer and direction)."""
        with self._lock:
            for t in transfers:
                if t.peer in self._broken:
                    t.finish(TransportError(self._broken[t.peer]))
                else:
                    self._queues[(t.peer, t.kind)].append(t)
            self._lock.notify()

    def break_pipes(self, peers: set[int], reason: str, state: int = GAVE_UP) -> None:
        """Fail every transfer with ``peers`` and tell them (``state``) that this side stopped."""
        with self._lock:
            for peer in peers:
                self._break(peer, reason, state)

    def close(self) -> None:
        """Stop the thread; tell every peer this side closed (it fails whatever it still waits for)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self.peers:
                self._break(peer, f"rank {self.rank} closed the ipc transport", CLOSED)
            self._lock.notify()
        self._thread.join(timeout=5)
        for peer in self.peers.values():
            peer.out.release()
            peer.inbound.release()

    # -- the thread -------------------------------------------------------------------------------

    def _break(self, peer: int, reason: str, state: int) -> None:  # holds the lock
        if peer not in self._broken:
            self._broken[peer] = reason
            self.peers[peer].out.say(state)
            self.peers[peer].inbound.say(state)
        for kind in ("send", "recv"):
            queue = self._queues[(peer, kind)]
            while queue:
                queue.popleft().finish(TransportError(self._broken[peer]))

    def _run(self) -> None:
        pause, checked = 5e-5, time.monotonic()
        while True:
            with self._lock:
                while not self._closed and not any(self._queues.values()):
                    self._lock.wait()
                    pause = 5e-5
                if self._closed:
                    return
                heads = [(key, q[0]) for key, q in self._queues.items() if q]
            moved = False
            for (peer, kind), transfer in heads:
                try:
                    moved |= self._move(self.peers[peer], kind, transfer)
                except Exception as exc:  # a size disagreement, or a copy that failed
                    reason = str(exc) if isinstance(exc, TransportError) else f"{type(exc).__name__}: {exc}"
                    with self._lock:
                        self._break(peer, reason, GAVE_UP)
            now = time.monotonic()
            if moved:
                pause, checked = 5e-5, now
                continue
            if now - checked >= LIVENESS_SECONDS:
                checked = now
                self._check_peers({peer for (peer, _), _ in heads})
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _move(self, peer: Peer, kind: str, transfer: Transfer) -> bool:
        """Move chunks of ``transfer`` (and the transfers queued after it) while the ring lets us."""
        moved = False
        queue = self._queues[(peer.rank, kind)]
        while not transfer.done.is_set():
            if kind == "recv":
                moved |= self._pull(peer, transfer)
            elif transfer.handle is not None:
                moved |= self._hand_over(peer.out, transfer)
            else:
                moved |= self._push(peer.out, transfer)
            if transfer.moved < transfer.data.numel():
                return moved
            with self._lock:
                if transfer.done.is_set():  # broken meanwhile: its error stands
                    return moved
                if queue and queue[0] is transfer:
                    queue.popleft()
                transfer.finish()
                if not queue:
                    return moved
                transfer = queue[0]
        return moved

    @staticmethod
    def _push(channel: Any, transfer: Transfer) -> bool:
        """Write chunks of a send into the free slots."""
        moved, size = False, transfer.data.numel()
        while transfer.moved < size and channel.free() > 0:
            n = min(channel.slot_bytes, size - transfer.moved)
            channel.put(transfer.data[transfer.moved : transfer.moved + n], transfer.task)
            transfer.moved += n
            moved = True
        return moved

    def _pull(self, peer: Peer, transfer: Transfer) -> bool:
        """Copy out the chunks (or the handle) of a receive that have arrived."""
        moved, size, channel = False, transfer.data.numel(), peer.inbound
        while transfer.moved < size and channel.ready() > 0:
            n = min(channel.slot_bytes, size - transfer.moved)
            length, task = channel.head()
            if length < 0 and transfer.moved == 0:  # a handle: the whole message at once
                self._take_over(peer, channel, -length, transfer)
                return True
            if length != n:
                raise TransportError(
                    f"rank {peer.rank} sent a chunk of {length} bytes (task {task}) where this rank "
                    f"expects {n} bytes of task {transfer.task & TASK_MASK}: the two ranks' messages "
                    "disagree"
                )
            channel.take(transfer.data[transfer.moved : transfer.moved + n])
            transfer.moved += n
            moved = True
        return moved

    @staticmethod
    def _hand_over(channel: Any, transfer: Transfer) -> bool:
        """Publish ``transfer``'s handle once; it is done when the receiver consumed it."""
        moved = False
        if not transfer.ack_at:
            if channel.free() == 0:
                return False
            transfer.ack_at = channel.put_handle(transfer.handle, transfer.task)
            moved = True
        if channel.consumed() >= transfer.ack_at:
            transfer.moved = transfer.data.numel()
            moved = True
        return moved

    def _take_over(self, peer: Peer, channel: Any, length: int, transfer: Transfer) -> None:
        """Copy a whole message out of the sender's GPU memory into ``transfer.target``."""
        from .cuda_ipc import copy_out

        size = transfer.data.numel()
        got = copy_out(channel.read_handle(length), transfer.target, self.gpus)
        if got != size:
            raise TransportError(
                f"rank {peer.rank} handed over a message of {got} bytes where this rank expects {size} "
                f"bytes of task {transfer.task & TASK_MASK}: the two ranks' messages disagree"
            )
        channel.skip()
        transfer.moved = size
        if transfer.landed is not None:
            transfer.landed()

    def _check_peers(self, ranks: set[int]) -> None:
        """Break the pipes of peers that stopped (said so, or whose process is gone)."""
        for rank in ranks:
            peer = self.peers[rank]
            state = max(peer.out.other_state(), peer.inbound.other_state())
            reason = None
            if state == CLOSED:
                reason = f"rank {rank} closed its ipc transport"
            elif state == GAVE_UP:
                reason = f"rank {rank} gave up on its channel with rank {self.rank} (its refit failed)"
            elif state == OPEN and peer.pid is not None and not alive(peer.pid):
                reason = f"rank {rank} exited (its process {peer.pid} is gone)"
            if reason is not None:
                with self._lock:
                    self._break(rank, reason, GAVE_UP)
