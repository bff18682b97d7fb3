"""Over a real Gloo world (3 processes, loopback): schedule agreement, the unique-id broadcast, and
the NVSHMEM bootstrap bookkeeping driven through a stand-in for ``nvshmem.core`` (no GPU here)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from reshard_nvshmem.exchange import (
    LocalRun,
    RunSchedules,
    all_gather_sends,
    broadcast_bytes,
    check_receives,
    group_rank,
)
from reshard_nvshmem.schedule import Message, StagingConfig

from reshard_core.errors import TransportError
from reshard_core.testing.world import run_world

CFG = StagingConfig(slot_bytes=1024, slots=2, align=16, min_piece=1)
UID_DTYPE = [("version", "<i4"), ("internal", "u1", (124,))]


class FakeNvshmem:
    """Stand-in for ``nvshmem.core``: records bootstrap calls; the unique id is a numpy record like
    nvshmem4py's (``_data``), filled with a recognisable pattern on rank 0 only."""

    def __init__(self, rank: int, preinit: tuple[int, int] | None = None):
        self.rank, self.calls = rank, []
        self.status = "STATUS_IS_INITIALIZED" if preinit else "STATUS_NOT_INITIALIZED"
        self.pe = preinit

    def get_version(self) -> str:
        return "fake"

    def init_status(self):
        return SimpleNamespace(name=self.status)

    def get_unique_id(self, empty: bool = False):
        data = np.zeros(1, dtype=UID_DTYPE).view(np.recarray)
        if not empty:
            data.version[0], data.internal[0] = 7, np.arange(124, dtype=np.uint8)
        return SimpleNamespace(_data=data)

    def init(self, device, uid, rank, nranks, initializer_method) -> None:
        raw = np.asarray(uid._data).view(np.uint8)
        self.calls.append(("init", raw.tobytes(), rank, nranks, initializer_method))
        self.status, self.pe = "STATUS_IS_INITIALIZED", (rank, nranks)

    def finalize(self) -> None:
        self.calls.append(("finalize",))
        self.status = "STATUS_NOT_INITIALIZED"

    def my_pe(self) -> int:
        return self.pe[0]

    def n_pes(self) -> int:
        return self.pe[1]


def _bootstrap_checks(rank: int, world: int) -> dict:
    import torch
    from reshard_nvshmem import symmetric

    torch.cuda.current_device = lambda: 0  # no GPU here: the device is only handed to init
    device = SimpleNamespace(set_current=lambda: None)
    symmetric._cuda_core = lambda: SimpleNamespace(Device=lambda index: device)
    runtime = symmetric.NvshmemRuntime
    nv = FakeNvshmem(rank)
    runtime.acquire(nv, None)  # bootstraps: uid from rank 0, broadcast as bytes
    runtime.acquire(nv, None)  # a second service shares it
    runtime.release(nv)
    after_one_release = list(nv.calls)
    runtime.release(nv)  # the last user finalizes
    out = {"bootstrap": after_one_release, "all": nv.calls}

    app = FakeNvshmem(rank, preinit=(rank, world))  # the application initialised NVSHMEM itself
    runtime.acquire(app, None)
    runtime.release(app)
    out["app_owned"] = app.calls
    try:
        runtime.acquire(FakeNvshmem(rank, preinit=((rank + 1) % world, world)), None)
    except TransportError as exc:
        out["wrong_pe"] = str(exc)
    return out


def ring_run(rank: int, world: int, scale: int = 1) -> LocalRun:
    """Rank r sends 100·(r+1)·scale bytes to r+1 and 7 bytes to r+2 (mod world)."""
    sends = (((rank + 1) % world, 100 * (rank + 1) * scale), ((rank + 2) % world, 7))
    prev, prev2 = (rank - 1) % world, (rank - 2) % world
    recvs = ((prev, 100 * (prev + 1) * scale), (prev2, 7))
    return LocalRun(sends, tuple(sorted(recvs)))


def _world_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    out["uid"] = broadcast_bytes(bytes(range(16)) if rank == 0 else None, 16, None)
    out["messages"] = all_gather_sends(ring_run(rank, world).sends, None)

    sub = dist.new_group([0, 2])
    out["group_rank_of_2"] = group_rank(sub, 2)
    try:
        group_rank(sub, 1)
    except TransportError as exc:
        out["not_member"] = str(exc)

    book = RunSchedules(None, CFG)
    book.schedule_for(ring_run(rank, world))
    book.schedule_for(ring_run(rank, world))
    out["gathers_unbound"] = book.gathers  # no plan key: every run gathers

    first = []
    book.begin_plan("plan-A")
    first.append(book.schedule_for(ring_run(rank, world)))
    first.append(book.schedule_for(ring_run(rank, world, scale=3)))
    after_first_refit = book.gathers
    book.begin_plan("plan-A")  # the next refit of the same plan: cached, no collective
    again = [book.schedule_for(ring_run(rank, world)), book.schedule_for(ring_run(rank, world, scale=3))]
    out["gathers_plan"] = (after_first_refit, book.gathers)
    out["same_schedules"] = all(a is b for a, b in zip(first, again, strict=True))
    out["rounds"] = [s.rounds for s in first]

    book.begin_plan("plan-A")
    try:  # rank 1 changed its messages but reuses the key: it raises, nobody waits on it
        book.schedule_for(ring_run(rank, world, scale=2 if rank == 1 else 1))
    except TransportError as exc:
        out["stale_key"] = str(exc)

    book.begin_plan(None)
    run = ring_run(rank, world)
    if rank == 2:  # posts a receive of the wrong size from rank 0
        run = LocalRun(run.sends, tuple((src, 99 if src == 0 else n) for src, n in run.recvs))
    try:
        book.schedule_for(run)
    except TransportError as exc:
        out["bad_recv"] = str(exc)

    lonely = dist.new_group([0, 1])  # its gather is left pending: used last, by rank 0 only
    if rank == 0:
        start = time.monotonic()
        try:
            RunSchedules(lonely, CFG).schedule_for(LocalRun((), ((1, 16),)), timeout=0.5)
        except TransportError as exc:
            out["absent_peer"] = (str(exc), time.monotonic() - start)
    dist.barrier()  # ranks 1 and 2 stay until rank 0 gave up
    return out


def _all_checks(rank: int, world: int) -> dict:
    return {**_bootstrap_checks(rank, world), **_world_checks(rank, world)}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(_all_checks, 3, timeout=120)


def test_bootstrap_broadcasts_rank0s_unique_id_and_finalizes_with_the_last_user(world_results) -> None:
    uid = bytes(np.array([(7, np.arange(124))], dtype=UID_DTYPE).view(np.uint8))
    for rank, r in enumerate(world_results):
        assert r["bootstrap"] == [("init", uid, rank, 3, "uid")]  # once, for two services
        assert r["all"] == [("init", uid, rank, 3, "uid"), ("finalize",)]


def test_bootstrap_reuses_an_application_initialised_nvshmem(world_results) -> None:
    for rank, r in enumerate(world_results):
        assert r["app_owned"] == []  # neither initialised nor finalized by us
        assert r["wrong_pe"] == (
            f"NVSHMEM was initialised elsewhere as PE {(rank + 1) % 3} of 3, but this rank is {rank} of 3 "
            "in the transport's group"
        )


def test_unique_id_bytes_reach_every_rank(world_results: list[dict]) -> None:
    assert [r["uid"] for r in world_results] == [bytes(range(16))] * 3


def test_gathered_message_list_is_global_and_ordered(world_results: list[dict]) -> None:
    expected = [
        Message(0, 1, 0, 100), Message(0, 2, 0, 7),
        Message(1, 2, 0, 200), Message(1, 0, 0, 7),
        Message(2, 0, 0, 300), Message(2, 1, 0, 7),
    ]  # fmt: skip
    assert all(r["messages"] == expected for r in world_results)


def test_group_ranks_map_and_non_members_fail(world_results: list[dict]) -> None:
    assert world_results[0]["group_rank_of_2"] == 1
    assert world_results[0]["not_member"] == "rank 1 is not a member of the transport's process group"


def test_plan_key_caches_runs_after_the_first_refit(world_results: list[dict]) -> None:
    for r in world_results:
        assert r["gathers_unbound"] == 2
        assert r["gathers_plan"] == (4, 4)  # two gathers for the first refit, none for the second
        assert r["same_schedules"]
        assert r["rounds"] == [1, 1]


def test_reused_plan_key_with_other_messages_raises_on_that_rank(world_results: list[dict]) -> None:
    assert "stale_key" not in world_results[0] and "stale_key" not in world_results[2]
    assert world_results[1]["stale_key"] == (
        "run 0 of plan 'plan-A' on rank 1 moves other messages than when the plan was first run; "
        "bind a new plan key"
    )


def test_mismatched_receive_names_both_ranks(world_results: list[dict]) -> None:
    assert "bad_recv" not in world_results[0] and "bad_recv" not in world_results[1]
    assert world_results[2]["bad_recv"] == (
        "rank 0 sends rank 2 messages of [7] bytes, but rank 2 posted receives of [99] bytes"
    )


def test_a_peer_that_never_joins_is_named_within_the_timeout(world_results: list[dict]) -> None:
    text, waited = world_results[0]["absent_peer"]
    assert text == "rank 1 did not join this run's nvshmem schedule exchange in time"
    assert waited < 30  # a hang guard, not a speed assertion


def test_check_receives_accepts_a_match() -> None:
    messages = [Message(0, 1, 0, 5), Message(0, 1, 1, 6)]
    check_receives(messages, 1, LocalRun((), ((0, 5), (0, 6))), [0, 1])
    with pytest.raises(TransportError, match=r"of \[5, 6\] bytes, but rank 1 posted receives of \[\]"):
        check_receives(messages, 1, LocalRun((), ()), [0, 1])
