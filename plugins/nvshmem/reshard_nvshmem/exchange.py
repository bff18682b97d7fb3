"""How the two ends of each pair agree on a run, and the unique-id broadcast, over torch.distributed.

Choice: no global step per run. The executor calls ``run()`` only on the ranks that take part in a
batch (an idle rank never calls it), so anything collective per run would hang; and a per-plan
collective would need the plan, which a ``CopyService`` never sees. Instead each run does a
two-step handshake with each peer it exchanges bytes with, all requests posted at once:

1. both ends send ``(count, bytes, CRC of the sizes)`` of what they send to and expect from the
   other, plus their total outgoing bytes in the run; a mismatch is one ``TransportError`` on both
   ends naming both ranks;
2. each receiver answers each sender with its ``Share`` (``schedule.receiver_layout``, which needs
   the senders' totals), and the sender derives its pieces from it (``schedule.sender_pieces``).

A peer that never answers is named after the timeout. Layouts are memoised on the sizes, so a
plan's later refits recompute nothing; the handshake itself is a few int64 per peer and run.
"""

from __future__ import annotations

import datetime
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard_core import TransportError

from .schedule import RankSchedule, Share, StagingConfig, receiver_layout, sender_pieces


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


@dataclass(frozen=True)
class LocalRun:
    """One rank's view of a run: ``(peer group rank, nbytes)`` of its sends and receives, in order."""

    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]


def summary(sizes: Sequence[int]) -> tuple[int, int, int]:
    """(count, bytes, CRC-32 of the sizes) of the messages one end moves to the other."""
    return len(sizes), sum(sizes), zlib.crc32(struct.pack(f"<{len(sizes)}q", *sizes))


def _describe(count: int, nbytes: int) -> str:
    return f"{count} message(s) of {nbytes} bytes"


def agree_run(
    run: LocalRun,
    me: int,
    group: dist.ProcessGroup | None,
    ranks: Sequence[int],
    config: StagingConfig,
    timeout: float | None = None,
) -> RankSchedule:
    """This rank's part of the run, agreed with each peer (``ranks[g]``: group rank ``g``'s global
    rank). Raises ``TransportError`` naming the ranks on a mismatch, and naming the peers that did
    not answer when ``timeout`` seconds pass (the group is unusable after that)."""
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    for peer, nbytes in run.sends:
        sends.setdefault(peer, []).append(nbytes)
    for peer, nbytes in run.recvs:
        recvs.setdefault(peer, []).append(nbytes)
    peers = sorted(set(sends) | set(recvs))
    if not peers:
        return RankSchedule(config, (), (), 0)
    out_total = sum(n for _, n in run.sends)
    mine = {p: [*summary(sends.get(p, [])), out_total, *summary(recvs.get(p, []))] for p in peers}
    theirs = _swap(mine, peers, 7, ranks, group, timeout)
    problems = []
    for p in peers:
        sent_to_me, expected_from_me = tuple(theirs[p][0:3]), tuple(theirs[p][4:7])
        if sent_to_me != summary(recvs.get(p, [])):
            problems.append(
                f"rank {ranks[p]} sends rank {ranks[me]} {_describe(*sent_to_me[:2])}, but rank "
                f"{ranks[me]} posted receives for {_describe(*summary(recvs.get(p, []))[:2])}"
            )
        if expected_from_me != summary(sends.get(p, [])):
            problems.append(
                f"rank {ranks[me]} sends rank {ranks[p]} {_describe(*summary(sends.get(p, []))[:2])}, "
                f"but rank {ranks[p]} posted receives for {_describe(*expected_from_me[:2])}"
            )
    senders_out = tuple((p, theirs[p][3]) for p in sorted(recvs))
    try:
        layout = receiver_layout(me, run.recvs, senders_out, len(ranks), config)
        told = {p: [layout.shares[p].offset, layout.shares[p].per_round] for p in recvs}
    except ValueError as exc:
        problems.append(f"rank {ranks[me]} cannot lay out its slots: {exc}")
        told = {p: [-1, -1] for p in recvs}
    # Step 2 runs even after a mismatch, so that peers with nothing wrong are not left waiting.
    shares = _swap(told, peers, 2, ranks, group, timeout, expect=sorted(sends))
    problems += [f"rank {ranks[p]} cannot lay out its slots" for p in sorted(sends) if shares[p][0] < 0]
    if problems:
        raise TransportError("; ".join(problems))
    pieces = tuple(
        piece
        for dst in sorted(sends)
        for piece in sender_pieces(me, dst, sends[dst], Share(*shares[dst]), config)
    )
    return RankSchedule(config, pieces, layout.pieces, layout.rounds)


def _swap(
    outgoing: dict[int, list[int]],
    peers: Sequence[int],
    width: int,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    timeout: float | None,
    expect: Sequence[int] | None = None,
) -> dict[int, list[int]]:
    """Send ``outgoing[p]`` (``width`` int64) to each of its peers and receive the same from each
    peer in ``expect`` (default: ``peers``); all posted at once."""
    device = collective_device(group)
    expect = peers if expect is None else expect
    sent = {p: torch.tensor(v, dtype=torch.int64, device=device) for p, v in outgoing.items()}
    got = {p: torch.empty(width, dtype=torch.int64, device=device) for p in expect}
    nccl = dist.get_backend(group) == "nccl"
    if nccl:  # NCCL wants its P2P in one batch: one request for all
        ops = [dist.P2POp(dist.isend, t, ranks[p], group) for p, t in sent.items()]
        ops += [dist.P2POp(dist.irecv, t, ranks[p], group) for p, t in got.items()]
        works = [(None, w) for w in (dist.batch_isend_irecv(ops) if ops else [])]
    else:
        works = [(None, dist.isend(t, ranks[p], group=group)) for p, t in sent.items()]
        works += [(p, dist.irecv(t, ranks[p], group=group)) for p, t in got.items()]
    _wait_all(works, peers, ranks, timeout, poll=nccl)
    return {p: t.tolist() for p, t in got.items()}


def _wait_all(
    works: list, peers: Sequence[int], ranks: Sequence[int], timeout: float | None, poll: bool
) -> None:
    """Wait for the handshake's requests; name the peers still missing at the deadline.

    ``poll``: NCCL requests complete on their own and are polled; Gloo's point-to-point requests
    complete only inside ``wait``, which takes a timeout."""
    deadline = time.monotonic() + (timeout if timeout is not None else 10.0**9)
    late: list[int] = []
    errors: list[str] = []
    for peer, work in works:
        try:
            if not poll:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                continue
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.0002)
            work.wait()
        except (RuntimeError, TimeoutError) as exc:
            late += [ranks[peer]] if peer is not None else [ranks[p] for p in peers]
            if isinstance(exc, RuntimeError) and time.monotonic() < deadline:  # failed, not late
                errors.append(" ".join(str(exc).split()))
    if late:
        who = ranks_text(sorted(set(late)))
        if errors:
            raise TransportError(f"nvshmem handshake with {who} failed: {errors[0]}")
        raise TransportError(f"{who} did not take part in this run's nvshmem handshake in time")
