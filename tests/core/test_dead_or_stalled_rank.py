"""One rank stalls (SIGSTOP) or dies (SIGKILL) in the middle of a refit: every other rank raises
within ``timeout`` + 2 s, naming it, also a rank that only waits on a neighbour of it.

3-rank Gloo worlds, as in ``test_one_rank_failures.py``: rank 0 holds the source and hosts the
default store; ranks 1 and 2 hold destination halves, and the refit verifies its arrivals (so rank 2
also waits for rank 0's digest after the data). After one good refit, the victim stops or kills
itself where its transport would start. The survivors report ``(seconds, error)`` with ``emit``,
and the same for one more refit, which must raise at once that the group is broken; the test ends
the world (the victim never returns) once both reported.

- Victim 0, the store's host: a TCPStore's ``add`` and ``check`` wait for their answer without a
  bound, so before store calls were bounded the ranks reading the failure board hung there for as
  long as rank 0 stayed stopped.
- Victim 1: rank 0 sees it fail (its send to rank 1 breaks); rank 2, which only waits on rank 0,
  used to report rank 0 ("recv from rank 0 ... timed out"). Rank 0 now relays the first failure on
  the board, and rank 2 names rank 1.
"""

from __future__ import annotations

import time

import pytest
from three_ranks import models
from victims import stop_or_kill_at_transport_start, timed

from reshard_core.testing.world import WorldStopped, run_world

pytestmark = pytest.mark.slow

TIMEOUT = 3.0
SLACK = 2.0


def _world(rank: int, world: int, victim: int, how: str, verify: bool) -> None:
    import reshard_core
    from reshard_core.testing.world import emit

    src, dst = models(rank)
    reshard_core.refit(src, dst, timeout=TIMEOUT, verify=verify)  # one good refit: the transport is warm
    if rank == victim:
        stop_or_kill_at_transport_start(how)
    outcome = timed(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT, verify=verify))
    again = timed(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT, verify=verify))
    emit("outcome", (*outcome, *again))
    time.sleep(60)  # the test ends the world once both survivors reported


def _outcomes(victim: int, how: str, verify: bool = True) -> dict[int, tuple[float, str]]:
    outcomes: dict[int, tuple[float, str]] = {}

    def on_event(rank: int, kind: str, data: tuple[float, str]) -> None:
        outcomes[rank] = data

    def watchdog() -> str | None:
        return "both survivors reported" if len(outcomes) == 2 else None

    with pytest.raises(WorldStopped):
        run_world(_world, 3, victim, how, verify, timeout=120, on_event=on_event, watchdog=watchdog)
    assert sorted(outcomes) == sorted({0, 1, 2} - {victim}), outcomes
    for rank, (seconds, text, again_seconds, again) in outcomes.items():
        assert text.startswith(("TransportError: ", "PeerFailed: ")), (rank, text)  # PeerFailed is one
        assert seconds < TIMEOUT + SLACK, (rank, seconds, text)
        # the next refit on the group raises at once, before any collective, saying how to go on
        broken = f"BrokenGroup: rank {rank}: this refit group is broken: an earlier refit on it failed "
        assert again.startswith(broken), again
        assert again.endswith("dist.init_process_group), or restart the job"), again
        assert again_seconds < 1.0, (rank, again_seconds)
    return {rank: text for rank, (_, text, _, _) in outcomes.items()}


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_the_store_host_stalled_or_dead_is_named_by_every_other_rank_in_time(how: str) -> None:
    texts = _outcomes(0, how)
    for rank, text in texts.items():
        if how == "stop":
            assert "the group's store (hosted by rank 0) did not answer within" in text, (rank, text)
            assert "rank 0 stalled or died" in text, (rank, text)
        else:
            assert "from rank 0" in text, (rank, text)  # what it waited for; then, reading the board:
            assert "the group's store (hosted by rank 0) is gone (" in text, (rank, text)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_rank_that_only_waits_on_a_neighbour_names_the_rank_that_failed_first(how: str) -> None:
    texts = _outcomes(1, how)
    first_hand = "timed out after 3 s" if how == "stop" else "connection closed by the peer"
    assert "gloo: send to rank 1" in texts[0] and first_hand in texts[0], texts[0]
    assert "recv from rank 0" in texts[2], texts[2]  # what it waited for, and who failed first:
    assert "rank 1 failed first (seen by rank 0: TransportError: " in texts[2], texts[2]
    assert "send to rank 1" in texts[2], texts[2]


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_rank_whose_own_part_succeeded_still_raises_naming_the_rank_that_failed_first(how: str) -> None:
    """Without ``verify`` rank 2 has nothing to wait for after its data from rank 0 arrived: it used
    to return success while rank 0 raised. The closing round makes it raise, naming rank 1."""
    texts = _outcomes(1, how, verify=False)
    first_hand = "timed out after 3 s" if how == "stop" else "connection closed by the peer"
    assert "gloo: send to rank 1" in texts[0] and first_hand in texts[0], texts[0]
    assert texts[2].startswith("PeerFailed: rank 2: refit could not finish: rank 1 failed first "), texts[2]
    assert "(seen by rank 0: TransportError: " in texts[2] and "send to rank 1" in texts[2], texts[2]
