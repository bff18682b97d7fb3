"""The process that hosts a ``TransferGroup``'s store (the trainer job's rank 0, as ``reshard-vllm``
sets it up) stalls (SIGSTOP) or dies (SIGKILL) in the middle of a refit into an engine job: every
other rank of both jobs raises within ``timeout`` + 2 s naming it, and its next refit on the group
raises at once that the group is broken and how to go on.

Trainer job: 2 ranks holding row halves of the source (group ranks 0, 1); engine job: 2 ranks
holding column halves of the destination (group ranks 2, 3). After one good refit, group rank 0
stops or kills itself where its transport would start. Survivors report ``(group rank, seconds,
error, seconds, next error)`` with ``emit``; the test ends both jobs once all three reported.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from victims import stop_or_kill_at_transport_start, timed

from reshard_core.testing.world import WorldStopped, free_port, run_jobs

pytestmark = pytest.mark.slow

ROWS, COLS = 8, 6
TIMEOUT = 3.0
SLACK = 2.0
SOURCE = torch.arange(float(ROWS * COLS)).reshape(ROWS, COLS)


def _side(rank: int, world: int, port: int, how: str, trainer: bool) -> None:
    import reshard_core
    from reshard_core import TransferGroup, declare_layout
    from reshard_core.testing.world import emit

    me = rank if trainer else 2 + rank
    job = range(0, 2) if trainer else range(2, 4)
    group = TransferGroup.join("127.0.0.1", port, rank=me, size=4, job_ranks=job, timeout=30)
    model = nn.Module()
    w = SOURCE.chunk(2, 0)[rank].clone() if trainer else torch.zeros(ROWS, COLS // 2)
    model.w = nn.Parameter(w, requires_grad=False)
    declare_layout(model.w, dim=0 if trainer else 1)
    src, dst = (model, None) if trainer else (None, model)
    options = reshard_core.RefitOptions(group=group, timeout=TIMEOUT)
    reshard_core.refit(src, dst, options)  # one good refit: the transport is warm
    if me == 0:
        stop_or_kill_at_transport_start(how)
    outcome = timed(lambda: reshard_core.refit(src, dst, options))
    again = timed(lambda: reshard_core.refit(src, dst, options))
    emit("outcome", (me, *outcome, *again))
    time.sleep(60)  # the test ends both jobs once every survivor reported


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_the_transfer_groups_store_host_stalled_or_dead_is_named_by_both_jobs_in_time(how: str) -> None:
    outcomes: dict[int, tuple] = {}

    def on_event(rank: int, kind: str, data: tuple) -> None:
        outcomes[data[0]] = data[1:]

    port = free_port()
    with pytest.raises(WorldStopped):
        run_jobs((_side, 2, (port, how, True)), (_side, 2, (port, how, False)), timeout=120,
                 on_event=on_event, watchdog=lambda: "reported" if len(outcomes) == 3 else None)  # fmt: skip
    assert sorted(outcomes) == [1, 2, 3], outcomes
    for rank, (seconds, text, again_seconds, again) in outcomes.items():
        assert text.startswith(("TransportError: ", "StoreSilent: ")), (rank, text)  # StoreSilent is one
        assert seconds < TIMEOUT + SLACK, (rank, seconds, text)
        if how == "stop":
            assert "the group's store (hosted by rank 0) did not answer within" in text, (rank, text)
            assert text.endswith("rank 0 stalled or died"), (rank, text)
        else:
            assert "the group's store (hosted by rank 0) is gone (" in text, (rank, text)
        broken = f"BrokenGroup: rank {rank}: this refit group is broken: an earlier refit on it failed "
        assert again.startswith(broken), (rank, again)
        assert again.endswith("close the transfer group and join a new one"), (rank, again)
        assert again_seconds < 1.0, (rank, again_seconds)


def _gather(rank: int, world: int, port: int, trainer: bool) -> None:
    import os
    import signal

    from reshard_core import TransferGroup
    from reshard_core.testing.world import emit

    me = rank if trainer else 2 + rank
    job = range(0, 2) if trainer else range(2, 4)
    group = TransferGroup.join("127.0.0.1", port, rank=me, size=4, job_ranks=job, timeout=TIMEOUT)
    assert group.gather_text(f"r{me}") == ["r0", "r1", "r2", "r3"]
    group.store.add("read", 1)
    if me == 0:
        while group.store.add("read", 0) < 4:  # every rank read the first gather from this store
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGSTOP)
    emit("outcome", (me, *timed(lambda: group.gather_text("second", what="verdict"))))
    time.sleep(60)


def test_a_gather_through_a_stalled_store_host_ends_within_its_timeout() -> None:
    """A TCPStore ``wait`` whose host is stopped never returns (its cancel waits for an answer): the
    trainer's verdict round (``gather_text``) hung for the job's whole process-group timeout."""
    outcomes: dict[int, tuple] = {}
    port = free_port()
    with pytest.raises(WorldStopped):
        run_jobs((_gather, 2, (port, True)), (_gather, 2, (port, False)), timeout=120,
                 on_event=lambda r, k, d: outcomes.__setitem__(d[0], d[1:]),
                 watchdog=lambda: "reported" if len(outcomes) == 3 else None)  # fmt: skip
    assert sorted(outcomes) == [1, 2, 3], outcomes
    for rank, (seconds, text) in outcomes.items():
        assert text.startswith("TransportError: transfer group rank "), (rank, text)
        assert "verdict: the group's store at " in text, text
        assert "rank 0, its host, exited or stalled" in text, text
        assert seconds < TIMEOUT + 2.0 + SLACK, (rank, seconds, text)


def _host_then_stop(rank: int, world: int, port: int, flag: str) -> None:
    import os
    import signal
    from pathlib import Path

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # as rank 0's join does
    Path(flag).touch()
    os.kill(os.getpid(), signal.SIGSTOP)
    del store


def _join_late(rank: int, world: int, port: int, flag: str) -> None:
    from pathlib import Path

    from reshard_core import TransferGroup
    from reshard_core.testing.world import emit

    while not Path(flag).exists():
        time.sleep(0.05)
    time.sleep(0.2)  # the host is stopped by now
    emit("outcome", timed(lambda: TransferGroup.join("127.0.0.1", port, rank=1, size=2, job_ranks=range(1, 2),
                                                     timeout=TIMEOUT)))  # fmt: skip
    time.sleep(60)


def test_joining_a_group_whose_store_host_is_stopped_ends_within_its_timeout(tmp_path) -> None:
    """A TCPStore client waits for its handshake with a stopped host for good: a trainer whose
    rank 0 stalled in ``trainer_init`` left its other ranks stuck in ``TransferGroup.join``."""
    seen: list[tuple] = []
    port, flag = free_port(), str(tmp_path / "stopped")
    with pytest.raises(WorldStopped):
        run_jobs((_host_then_stop, 1, (port, flag)), (_join_late, 1, (port, flag)), timeout=120,
                 on_event=lambda r, k, d: seen.append(d),
                 watchdog=lambda: "reported" if seen else None)  # fmt: skip
    [(seconds, text)] = seen
    assert text.startswith(f"TransportError: transfer group rank 1: could not reach the rendezvous store at "
                           f"127.0.0.1:{port} within 3 s: "), text  # fmt: skip
    assert text.endswith("rank 0 stalled or died"), text
    assert seconds < TIMEOUT + 2.0 + SLACK, (seconds, text)
