"""Over a real Gloo world (3 processes, loopback): the per-run pairwise handshake, the unique-id
broadcast, and the NVSHMEM bootstrap bookkeeping driven through a stand-in for ``nvshmem.core``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from reshard_nvshmem.exchange import LocalRun, agree_run, broadcast_bytes, group_rank, summary
from reshard_nvshmem.schedule import Message, StagingConfig, build_schedule

from reshard_core.errors import TransportError
from reshard_core.testing.world import run_world

CFG = StagingConfig(slot_bytes=1024, slots=2, align=16, min_piece=1)
UID_DTYPE = [("version", "<i4"), ("internal", "u1", (124,))]


class FakeNvshmem:
    """Stand-in for ``nvshmem.core``: records bootstrap calls; the unique id is a numpy record like
    nvshmem4py's (``_data``), filled with a recognisable pattern on rank 0 only."""

    def __init__(self, rank: int, preinit: tuple[int, int] | None = None):
        self.rank, self.calls = rank, []
        self.status = 2 if preinit else 0  # nvshmem4py returns the C enum as a plain int
        self.pe = preinit

    def get_version(self) -> str:
        return "fake"

    def init_status(self) -> int:
        return self.status

    def get_unique_id(self, empty: bool = False):
        data = np.zeros(1, dtype=UID_DTYPE).view(np.recarray)
        if not empty:
            data.version[0], data.internal[0] = 7, np.arange(124, dtype=np.uint8)
        return SimpleNamespace(_data=data)

    def init(self, device, uid, rank, nranks, initializer_method) -> None:
        raw = np.asarray(uid._data).view(np.uint8)
        self.calls.append(("init", raw.tobytes(), rank, nranks, initializer_method))
        self.status, self.pe = 2, (rank, nranks)  # NVSHMEM_STATUS_IS_INITIALIZED

    def finalize(self) -> None:
        self.calls.append(("finalize",))
        self.status = 0  # NVSHMEM_STATUS_NOT_INITIALIZED

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
    return LocalRun(sends, recvs)


def ring_messages(world: int, scale: int = 1) -> list[Message]:
    run = [ring_run(r, world, scale) for r in range(world)]
    return [Message(r, dst, 0, n) for r in range(world) for dst, n in run[r].sends]


def _world_checks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    ranks = list(range(world))
    out["uid"] = broadcast_bytes(bytes(range(16)) if rank == 0 else None, 16, None)

    sub = dist.new_group([0, 2])
    out["group_rank_of_2"] = group_rank(sub, 2)
    try:
        group_rank(sub, 1)
    except TransportError as exc:
        out["not_member"] = str(exc)

    out["agreed"] = [agree_run(ring_run(rank, world, scale), rank, None, ranks, CFG, 60) for scale in (1, 5)]
    out["empty"] = agree_run(LocalRun((), ()), rank, None, ranks, CFG, 60)  # nothing to agree: no traffic

    run = ring_run(rank, world)
    if rank == 2:  # posts a receive of the wrong size from rank 0
        run = LocalRun(run.sends, tuple((src, 99 if src == 0 else n) for src, n in run.recvs))
    try:
        agree_run(run, rank, None, ranks, CFG, 60)
        out["bad_recv"] = "agreed"
    except TransportError as exc:
        out["bad_recv"] = str(exc)

    lonely = dist.new_group([0, 1])  # its handshake is left pending: used last, by rank 0 only
    if rank == 0:
        start = time.monotonic()
        try:
            agree_run(LocalRun((), ((1, 16),)), 0, lonely, [0, 1], CFG, timeout=0.5)
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


def test_group_ranks_map_and_non_members_fail(world_results: list[dict]) -> None:
    assert world_results[0]["group_rank_of_2"] == 1
    assert world_results[0]["not_member"] == "rank 1 is not a member of the transport's process group"


def test_each_rank_derives_its_part_of_the_global_layout(world_results: list[dict]) -> None:
    for k, scale in enumerate((1, 5)):
        schedule = build_schedule(ring_messages(3, scale), 3, CFG)
        for rank, r in enumerate(world_results):
            assert r["agreed"][k] == schedule.for_rank(rank)
    assert world_results[0]["agreed"][1].rounds == 2  # 1500 B from rank 2 through 1 KiB slots


def test_a_rank_without_traffic_agrees_on_nothing(world_results: list[dict]) -> None:
    for r in world_results:
        assert (r["empty"].sends, r["empty"].recvs, r["empty"].rounds) == ((), (), 0)


def test_mismatched_receive_fails_on_both_ends_naming_both_ranks(world_results: list[dict]) -> None:
    text = (
        "rank 0 sends rank 2 1 message(s) of 7 bytes, but rank 2 posted receives for 1 message(s) of 99 bytes"
    )
    assert world_results[2]["bad_recv"] == text
    assert world_results[0]["bad_recv"] == text
    assert world_results[1]["bad_recv"] == "agreed"  # not involved: finishes normally


def test_a_peer_that_never_joins_is_named_within_the_timeout(world_results: list[dict]) -> None:
    text, waited = world_results[0]["absent_peer"]
    assert text == "rank 1 did not take part in this run's nvshmem handshake in time"
    assert waited < 30  # a hang guard, not a speed assertion


def test_summary_counts_bytes_and_fingerprints_sizes() -> None:
    assert summary([]) == (0, 0, 0)
    assert summary([5, 6])[:2] == (2, 11) and summary([5, 6]) != summary([6, 5])


def test_cuda_core_device_is_found_under_experimental_in_cuda_core_0_3(monkeypatch) -> None:
    """cuda.core 0.3 (pinned): ``import cuda.core`` works, ``Device`` lives in ``cuda.core.experimental``."""
    import sys
    import types

    from reshard_nvshmem import symmetric

    cuda, core, experimental = (types.ModuleType(n) for n in ("cuda", "cuda.core", "cuda.core.experimental"))
    experimental.Device = object
    cuda.core, core.experimental = core, experimental
    for name, module in (("cuda", cuda), ("cuda.core", core), ("cuda.core.experimental", experimental)):
        monkeypatch.setitem(sys.modules, name, module)
    assert symmetric._cuda_core() is experimental
    core.Device = object  # cuda.core >= 0.4
    assert symmetric._cuda_core() is core


def test_init_status_is_read_as_nvshmem4pys_int() -> None:
    from reshard_nvshmem import symmetric

    for status, initialised in ((0, False), (1, False), (2, True), (3, True), (4, True)):
        nv = FakeNvshmem(0)
        nv.status = status
        assert symmetric._is_initialised(nv) is initialised
