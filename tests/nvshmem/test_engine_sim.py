"""The engine's signal protocol, run by a simulated world on CPU: exact data, no slot overwrite,
no deadlock, across consecutive runs whose signal counts carry over."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nvshmem_patterns import tp_dp_messages, transfer_sets
from nvshmem_sim import Deadlock, SimWorld, SlotConflict
from reshard_nvshmem.engine import byte_view, enqueue
from reshard_nvshmem.schedule import Message, StagingConfig, build_schedule
from reshard_nvshmem.slots import RankProgram, RecvStep, SendStep, SignalLedger


def simulate(world: int, cfg: StagingConfig, runs: list[list[Message]], seed: int = 0, tamper=None) -> int:
    """Run ``runs`` back to back on a simulated world; assert every byte arrived; return #puts."""
    sim = SimWorld(world, cfg.slots, cfg.slot_bytes)
    ledgers = [SignalLedger(cfg.slots) for _ in range(world)]
    gen = torch.Generator().manual_seed(seed)
    expected = []
    for messages in runs:
        schedule = build_schedule(messages, world, cfg)
        sends = [{} for _ in range(world)]
        recvs = [{} for _ in range(world)]
        for m in messages:
            data = torch.randint(0, 256, (m.nbytes,), dtype=torch.uint8, generator=gen)
            sends[m.src][(m.dst, m.order)] = data
            recvs[m.dst][(m.src, m.order)] = torch.zeros(m.nbytes, dtype=torch.uint8)
            expected.append((data, recvs[m.dst][(m.src, m.order)]))
        for rank in range(world):
            program = ledgers[rank].program(schedule.for_rank(rank))
            enqueue(tamper(program) if tamper else program, sends[rank], recvs[rank], sim.ops(rank))
    sim.run(seed)
    for data, received in expected:
        assert torch.equal(data, received)
    return sim.puts


def test_exact_program_and_counts_carry_over() -> None:
    cfg = StagingConfig(slot_bytes=256, slots=2, align=4, min_piece=1)
    sched = build_schedule([Message(0, 2, 0, 300), Message(1, 2, 0, 300)], 3, cfg)
    p = sched.pieces  # rounds 0, 1, 2, each with 100 B from rank 0 then 100 B from rank 1
    ledgers = [SignalLedger(2) for _ in range(3)]
    # SendStep: round, peer, credit to wait for, pieces
    expected = tuple(SendStep(t, 2, t + 1, (p[2 * t],)) for t in range(3))
    assert ledgers[0].program(sched.for_rank(0)).sends == expected
    assert ledgers[1].program(sched.for_rank(1)).sends[2] == SendStep(2, 2, 3, (p[5],))
    # RecvStep: round, slot, arrivals to wait for, pieces, then whom to grant
    assert ledgers[2].program(sched.for_rank(2)) == RankProgram(
        grants=(0, 1, 0, 1),  # rounds 0 and 1 go into free slots
        sends=(),
        recvs=(
            RecvStep(0, 0, 2, (p[0], p[1]), grants=(0, 1)),  # draining round 0 frees slot 0 for round 2
            RecvStep(1, 1, 2, (p[2], p[3]), grants=()),
            RecvStep(2, 0, 4, (p[4], p[5]), grants=()),
        ),
    )
    # A second run of the same plan waits for the next counts: the words are never reset.
    assert [s.credit for s in ledgers[0].program(sched.for_rank(0)).sends] == [4, 5, 6]
    assert [s.arrived for s in ledgers[2].program(sched.for_rank(2)).recvs] == [6, 4, 8]
    assert ledgers[2].arrivals == [8, 4] and ledgers[0].credits == {2: 6}


def test_byte_view_is_a_flat_alias() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    v = byte_view(t)
    assert v.dtype == torch.uint8 and v.shape == (12,) and v.data_ptr() == t.data_ptr()
    assert byte_view(torch.zeros(0, dtype=torch.float32)).shape == (0,)


@settings(max_examples=60, deadline=None)
@given(transfer_sets(), st.integers(1, 3), st.integers(0, 2**16))
def test_random_worlds_deliver_exactly(case, n_runs: int, seed: int) -> None:
    msgs, world, cfg = case
    # Consecutive runs: the same messages, then rotated peers, so the counts of later runs differ.
    runs = [
        [dataclasses.replace(m, src=(m.src + k) % world, dst=(m.dst + k) % world) for m in msgs]
        for k in range(n_runs)
    ]
    puts = simulate(world, cfg, runs, seed)
    assert puts == sum(len(build_schedule(run, world, cfg).pieces) for run in runs)


@pytest.mark.parametrize("seed", [0, 1])
def test_tp_dp_reshard_pattern_on_16_simulated_ranks(seed: int) -> None:
    messages = tp_dp_messages(
        world=16, src_tp=2, dst_tp=4, n_tensors=60, batches=2, hidden=64, ffn=128, vocab=256, kv=16
    )
    runs = [[dataclasses.replace(m, order=0) for m in messages if m.order == b] for b in range(2)]
    cfg = StagingConfig(slot_bytes=4096, slots=2, align=64, min_piece=256)
    assert max(build_schedule(run, 16, cfg).rounds for run in runs) >= 4  # slots really get reused
    assert simulate(16, cfg, runs, seed) > 0


def test_simulator_catches_a_missing_credit_wait() -> None:
    # Without credit waits a sender may refill a slot before its receiver drained it.
    def no_waits(program: RankProgram) -> RankProgram:
        sends = tuple(dataclasses.replace(s, credit=0) for s in program.sends)
        return dataclasses.replace(program, sends=sends)

    cfg = StagingConfig(slot_bytes=64, slots=1, align=1, min_piece=1)
    runs = [[Message(0, 1, 0, 64 * 8)]]
    simulate(2, cfg, runs)  # intact protocol: fine for every interleaving tried
    caught = 0
    for seed in range(10):
        try:
            simulate(2, cfg, runs, seed, tamper=no_waits)
        except SlotConflict:
            caught += 1
    assert caught > 0


def test_simulator_catches_missing_grants() -> None:
    def no_grants(program: RankProgram) -> RankProgram:
        return dataclasses.replace(program, grants=())

    cfg = StagingConfig(slot_bytes=64, slots=2, align=1, min_piece=1)
    with pytest.raises(Deadlock, match="no operation can run"):
        simulate(2, cfg, [[Message(0, 1, 0, 100)]], tamper=no_grants)
