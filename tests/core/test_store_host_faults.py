"""The rank that hosts the group's store stalls (SIGSTOP) or dies (SIGKILL) in the middle of a refit:
every other rank raises within ``timeout`` + 2 s, naming it.

A TCPStore client's ``add`` and ``check`` wait for their answer without a bound, so before store
calls were bounded, the ranks reading the failure board hung in them for as long as the host stayed
stopped. 3-rank Gloo worlds, as in ``test_one_rank_failures.py``: rank 0 holds the source and hosts
the default store; ranks 1 and 2 hold destination halves. After one good refit, rank 0 stops or
kills itself where its transport would start sending. Ranks 1 and 2 report ``(seconds, error)``
with ``emit``; the test ends the world (rank 0 never returns) once both reported.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

from reshard_core.testing.world import WorldStopped, run_world

pytestmark = pytest.mark.slow

TIMEOUT = 3.0
SLACK = 2.0


def _world(rank: int, world: int, how: str) -> None:
    import reshard_core
    from reshard_core import declare_layout
    from reshard_core.testing.world import emit

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(torch.arange(32.0).reshape(8, 4))
        declare_layout(src.w, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w = nn.Parameter(torch.zeros(4, 4))
        declare_layout(dst.w, dim=0, ranks=(1, 2))
    reshard_core.refit(src, dst, timeout=TIMEOUT)  # one good refit: the transport is warm
    if rank == 0:
        from reshard_gloo.transport import GlooCopyService

        def start(self):
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

        GlooCopyService.start = start
    start_time = time.monotonic()
    try:
        reshard_core.refit(src, dst, timeout=TIMEOUT)
        text = "no error"
    except Exception as exc:  # noqa: BLE001 - the text and the time are what the test checks
        text = f"{type(exc).__name__}: {exc}"
    emit("outcome", (time.monotonic() - start_time, text))
    if rank != 0:
        time.sleep(60)  # the test ends the world once both outcomes arrived


def _outcomes(how: str) -> dict[int, tuple[float, str]]:
    outcomes: dict[int, tuple[float, str]] = {}

    def on_event(rank: int, kind: str, data: tuple[float, str]) -> None:
        outcomes[rank] = data

    def watchdog() -> str | None:
        return "both reported" if len(outcomes) == 2 else None

    with pytest.raises(WorldStopped):
        run_world(_world, 3, how, timeout=120, on_event=on_event, watchdog=watchdog)
    return outcomes


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_every_other_rank_raises_in_time_naming_the_store_host(how: str) -> None:
    outcomes = _outcomes(how)
    assert sorted(outcomes) == [1, 2], outcomes
    for rank, (seconds, text) in outcomes.items():
        assert text.startswith("TransportError: "), (rank, text)
        assert "rank 0" in text, (rank, text)
        assert seconds < TIMEOUT + SLACK, (rank, seconds, text)
    if how == "stop":
        for rank, (_, text) in outcomes.items():
            assert "the group's store (hosted by rank 0) did not answer" in text, text
