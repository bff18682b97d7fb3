"""A rank stops (SIGSTOP) or dies (SIGKILL) in the middle of a refit over ``ipc``, with chunks of
its messages already moved: every other rank raises within ``timeout`` + 2 s naming it, the next
refit raises at once that the group is broken, and once the world's processes are gone nothing of
theirs is left in ``/dev/shm``.

3 ranks on one host: rank 0 holds an 8 MiB source, ranks 1 and 2 its halves, through 64 KiB slots
(64 chunks per message). After one good refit the victim, rank 1, stops or kills itself on its
fifth chunk copied out; rank 0's send to it then never finishes, and rank 2 (whose own data
arrived) learns of it in the refit's closing rounds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from reshard_core.testing.world import WorldStopped, run_world

pytestmark = pytest.mark.slow

TIMEOUT = 3.0
SLACK = 2.0
VICTIM = 1


def _models(rank: int):
    import torch
    from torch import nn

    from reshard_core import declare_layout

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024))
        declare_layout(src.w, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w = nn.Parameter(torch.zeros(1024, 1024))
        declare_layout(dst.w, dim=0, ranks=(1, 2))
    return src, dst


def _die_on_fifth_chunk(how: str) -> None:
    from reshard_ipc.channel import Channel

    taken = Channel.take
    count = [0]

    def take(self, out):
        count[0] += 1
        if count[0] == 5:
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        taken(self, out)

    Channel.take = take


def timed(attempt) -> tuple[float, str]:
    """``(seconds, outcome)`` of ``attempt()``: "no error", or its error as ``Type: text``."""
    start = time.monotonic()
    try:
        attempt()
        return time.monotonic() - start, "no error"
    except Exception as exc:  # noqa: BLE001 - the text and the time are what the test checks
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"


def _world(rank: int, world: int, how: str) -> None:
    import reshard_core
    from reshard_core.testing.world import emit

    os.environ["RESHARD_IPC_SLOT_BYTES"] = str(64 << 10)
    os.environ["RESHARD_IPC_SLOTS"] = "2"
    emit("pid", os.getpid())
    src, dst = _models(rank)
    reshard_core.refit(src, dst, transport="ipc", timeout=TIMEOUT, verify=True)  # a good one first
    if rank == VICTIM:
        _die_on_fifth_chunk(how)
    outcome = timed(lambda: reshard_core.refit(src, dst, transport="ipc", timeout=TIMEOUT, verify=True))
    again = timed(lambda: reshard_core.refit(src, dst, transport="ipc", timeout=TIMEOUT, verify=True))
    emit("outcome", (*outcome, *again))
    time.sleep(60)  # the test ends the world once both survivors reported


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_rank_stopped_or_killed_mid_stream_is_named_in_time_and_leaves_nothing_in_dev_shm(how):
    from reshard_ipc import segment

    outcomes: dict[int, tuple] = {}
    pids: list[int] = []

    def on_event(rank: int, kind: str, data) -> None:
        if kind == "pid":
            pids.append(data)
        else:
            outcomes[rank] = data

    with pytest.raises(WorldStopped):
        run_world(_world, 3, how, timeout=120, on_event=on_event,
                  watchdog=lambda: "both survivors reported" if len(outcomes) == 2 else None)  # fmt: skip
    assert sorted(outcomes) == [0, 2], outcomes
    for rank, (seconds, text, again_seconds, again) in outcomes.items():
        assert text.startswith(("TransportError: ", "PeerFailed: ")), (rank, text)
        assert "rank 1" in text, (rank, text)
        assert seconds < TIMEOUT + SLACK, (rank, seconds, text)
        assert again.startswith(f"BrokenGroup: rank {rank}: this refit group is broken"), (rank, again)
        assert again_seconds < 1.0, (rank, again_seconds)
    if how == "kill":  # the pump saw the process gone: no need to wait out the timeout
        assert "rank 1 exited (its process" in outcomes[0][1], outcomes[0][1]
    left = [n for n in segment.ours() for pid in pids if n.startswith(f"{segment.PREFIX}{pid}-")]
    assert left == [], left
