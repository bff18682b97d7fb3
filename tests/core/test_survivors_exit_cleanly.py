"""After a peer's fault, every surviving process ends with exit status 0 once its script is done,
and names the rank that failed first (3-rank Gloo worlds of separate processes, ``exiting_rank``).

- A stalled store host (SIGSTOP, then SIGKILL as a scheduler would) used to abort the survivors at
  exit (status -6, "terminate called without an active exception"): a store call left blocked on a
  helper thread got the host's connection reset while the interpreter was shutting down. The
  stopped victim is killed the moment both survivors reported, so that reset lands while they exit.
- Likewise a dead receiver (rank 1): the failure board's watcher thread was still inside the Gloo
  wait it breaks when the store host exited, and rank 2 aborted at exit.
- A dead receiver, and rank 2 late to the refit: rank 0, which hosts the store, used to exit as soon
  as it raised, and rank 2, reading the board after that, blamed the store's host ("the group's store
  (hosted by rank 0) is gone") instead of rank 1. The host now stays until every peer has learnt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard_core.testing.world import free_port

pytestmark = pytest.mark.slow

RANK = str(Path(__file__).with_name("exiting_rank.py"))


def _world(victim: int, how: str, *extra: str) -> dict[int, tuple[int, str, str]]:
    """``{survivor: (exit status, outcome, stderr)}``; ``extra``: more arguments of each rank."""
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    procs = [
        subprocess.Popen(
            [sys.executable, RANK, str(r), str(victim), how, port, *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(3)
    ]
    survivors = [r for r in range(3) if r != victim]
    try:
        lines = {r: procs[r].stdout.readline().strip() for r in survivors}
        procs[victim].kill()  # a stopped victim dies now, while the survivors exit
        out = {}
        for r in survivors:
            code = procs[r].wait(timeout=60)
            out[r] = (code, lines[r], procs[r].stderr.read()[-3000:])
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("victim", "how"), [(0, "stop"), (0, "kill"), (1, "stop"), (1, "kill")])
def test_every_survivor_exits_with_status_0_and_names_the_failed_rank(victim: int, how: str) -> None:
    for rank, (code, line, err) in _world(victim, how).items():
        assert code == 0, (rank, code, line, err)
        assert line.startswith(f"RESULT {rank} ") and "Error: " in line, line
        if victim == 0:
            assert "the group's store (hosted by rank 0)" in line, line
        elif rank == 2:
            assert "rank 1 failed first" in line, line


def test_the_store_host_stays_until_the_last_rank_has_learnt_which_rank_failed_first() -> None:
    outcomes = _world(1, "kill", "2")  # rank 2 comes to the refit 2 s late
    for rank, (code, line, err) in outcomes.items():
        assert code == 0, (rank, code, line, err)
    assert "rank 1 failed first (seen by rank 0: " in outcomes[2][1], outcomes[2][1]
