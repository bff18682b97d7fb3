"""How all ranks agree on a run's schedule, and the unique-id broadcast, over a torch.distributed group.

Choice: the schedule is a pure function of the run's global message list (who sends how many
bytes to whom, in which order). A rank only knows its own sends and receives, so the list is
gathered once with one small ``all_gather`` of ``(dst, nbytes)`` int64 pairs (no pickle).

When gathering may be skipped: a cache keyed by a rank's *own* messages is unsafe (a rank whose
messages did not change would skip the collective that a changed peer enters, and both hang), so
the cache is keyed by a plan identity every rank shares. After ``begin_plan(key)`` on every rank,
the n-th run is cached under ``(key, n)``: the first refit of a plan gathers once per run, later
refits of that plan gather nothing. Without a plan key every run gathers (always correct). A rank
whose messages differ from the ones cached for ``(key, n)`` raises instead of guessing.

Every rank of the group calls ``run()`` once per batch, also with nothing queued, because the
gather is collective. A gather that a peer never joins fails after the transport's timeout with a
``TransportError`` naming the peers this rank exchanges with in that run.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard_core.errors import TransportError

from .schedule import Message, Schedule, StagingConfig, cached_schedule

MAX_CACHED_RUNS = 4096


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for collectives on ``group`` must live (CUDA only for a pure NCCL group)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_rank(group: dist.ProcessGroup | None, global_rank: int) -> int:
    """``global_rank``'s rank inside ``group``; ``TransportError`` when it is not a member."""
    if group is None or group is dist.group.WORLD:
        if not 0 <= global_rank < dist.get_world_size():
            raise TransportError(f"rank {global_rank} is outside the world of {dist.get_world_size()} ranks")
        return global_rank
    try:
        return dist.get_group_rank(group, global_rank)
    except (ValueError, RuntimeError):
        raise TransportError(f"rank {global_rank} is not a member of the transport's process group") from None


def broadcast_bytes(payload: bytes | None, nbytes: int, group: dist.ProcessGroup | None) -> bytes:
    """Group rank 0's ``payload`` (``nbytes`` long) on every rank, sent as a uint8 tensor."""
    device = collective_device(group)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    if dist.get_rank(group) == 0:
        if payload is None or len(payload) != nbytes:
            raise TransportError(f"broadcast payload must be {nbytes} bytes on rank 0")
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return bytes(buf.cpu().numpy().tobytes())


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 1, 4`` / ``a rank`` (for error messages)."""
    if not ranks:
        return "a rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _all_gather(rows: list[torch.Tensor], mine: torch.Tensor, group, deadline: float, suspects: str) -> None:
    try:
        work = dist.all_gather(rows, mine, group=group, async_op=True)
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TransportError(f"{suspects} did not join this run's nvshmem schedule exchange in time")
            time.sleep(0.0002)
        work.wait()
    except RuntimeError as exc:  # a peer died or the group broke mid-gather
        text = " ".join(str(exc).split())
        raise TransportError(f"nvshmem schedule exchange with {suspects} failed: {text}") from exc


def all_gather_sends(
    sends: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None,
    timeout: float | None = None,
    suspects: str = "a rank",
) -> list[Message]:
    """The run's global message list from every rank's ``(dst group rank, nbytes)`` sends, in order.

    Raises ``TransportError`` naming ``suspects`` (the peers this rank exchanges with) when the
    gather does not complete within ``timeout`` seconds; the group is unusable afterwards."""
    device = collective_device(group)
    size = dist.get_world_size(group)
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    count = torch.tensor([len(sends)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(size)]
    _all_gather(counts, count, group, deadline, suspects)
    width = max(int(c.item()) for c in counts)
    if width == 0:
        return []
    mine = torch.full((width, 2), -1, dtype=torch.int64)
    if sends:
        mine[: len(sends)] = torch.tensor(sends, dtype=torch.int64)
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(size)]
    _all_gather(rows, mine, group, deadline, suspects)
    messages = []
    for src, (n, table) in enumerate(zip(counts, rows, strict=True)):
        orders: dict[int, int] = {}
        for dst, nbytes in table[: int(n.item())].cpu().tolist():
            messages.append(Message(src, dst, orders.get(dst, 0), nbytes))
            orders[dst] = orders.get(dst, 0) + 1
    return messages


@dataclass(frozen=True)
class LocalRun:
    """One rank's view of a run: ``(peer group rank, nbytes)`` of its sends and receives, in order."""

    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]


def check_receives(messages: Sequence[Message], me: int, run: LocalRun, ranks: Sequence[int]) -> None:
    """``TransportError`` unless what peers send ``me`` matches what ``me`` posted receives for.

    ``ranks[g]`` is group rank ``g``'s global rank (for the message)."""
    sent: dict[int, list[int]] = {}
    for m in messages:
        if m.dst == me:
            sent.setdefault(m.src, []).append(m.nbytes)
    posted: dict[int, list[int]] = {}
    for src, nbytes in run.recvs:
        posted.setdefault(src, []).append(nbytes)
    for src in sorted(set(sent) | set(posted)):
        if sent.get(src, []) != posted.get(src, []):
            raise TransportError(
                f"rank {ranks[src]} sends rank {ranks[me]} messages of {sent.get(src, [])} bytes, "
                f"but rank {ranks[me]} posted receives of {posted.get(src, [])} bytes"
            )


class RunSchedules:
    """The schedule of each run: gathered, or cached under ``(plan key, run index)``."""

    def __init__(self, group: dist.ProcessGroup | None, config: StagingConfig):
        self.group = group
        self.config = config
        self.me = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.ranks = [dist.get_global_rank(group or dist.group.WORLD, g) for g in range(self.size)]
        self.gathers = 0
        self._plan: Hashable | None = None
        self._index = 0
        self._cache: OrderedDict[tuple[Hashable, int], tuple[LocalRun, Schedule]] = OrderedDict()

    def begin_plan(self, key: Hashable | None) -> None:
        """Runs from now on belong to plan ``key`` (call on every rank, before each refit)."""
        self._plan, self._index = key, 0

    def schedule_for(self, run: LocalRun, timeout: float | None = None) -> Schedule:
        """This run's schedule (collective unless cached for the bound plan; ``timeout`` seconds)."""
        slot = (self._plan, self._index)
        self._index += 1
        if self._plan is not None and slot in self._cache:
            cached_run, schedule = self._cache[slot]
            if cached_run != run:
                raise TransportError(
                    f"run {slot[1]} of plan {self._plan!r} on rank {self.ranks[self.me]} moves other "
                    "messages than when the plan was first run; bind a new plan key"
                )
            return schedule
        peers = sorted({self.ranks[g] for g, _ in (*run.sends, *run.recvs)})
        messages = all_gather_sends(run.sends, self.group, timeout, ranks_text(peers))
        self.gathers += 1
        check_receives(messages, self.me, run, self.ranks)
        try:
            schedule = cached_schedule(tuple(messages), self.size, self.config)
        except ValueError as exc:
            raise TransportError(f"nvshmem schedule: {exc}") from None
        if self._plan is not None:
            self._cache[slot] = (run, schedule)
            while len(self._cache) > MAX_CACHED_RUNS:
                self._cache.popitem(last=False)
        return schedule
