"""The NVSHMEM schedule: exact delivery, no slot conflicts, capacities, rounds near the bound."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from nvshmem_patterns import tp_dp_messages, transfer_sets
from reshard_nvshmem.schedule import (
    Message,
    Piece,
    Schedule,
    StagingConfig,
    build_schedule,
    cached_schedule,
    lower_bound,
)

MiB = 1 << 20


def check_schedule(schedule: Schedule, messages: list[Message]) -> None:
    """Every invariant the engine relies on; fails with the first broken one."""
    cfg = schedule.config
    by_msg: dict[tuple[int, int, int], list[Piece]] = defaultdict(list)
    for p in schedule.pieces:
        by_msg[(p.src, p.dst, p.order)].append(p)
    sizes = {(m.src, m.dst, m.order): m.nbytes for m in messages}
    assert set(by_msg) <= set(sizes)
    for key, nbytes in sizes.items():
        pieces = sorted(by_msg.get(key, []), key=lambda p: p.msg_offset)
        cursor = 0
        for p in pieces:  # every byte exactly once, in message order
            assert p.msg_offset == cursor and p.nbytes > 0, (key, p)
            assert p.nbytes >= min(cfg.min_piece, cfg.slot_bytes) or p.msg_offset + p.nbytes == nbytes
            cursor += p.nbytes
        assert cursor == nbytes, key
        rounds = [p.round for p in pieces]
        assert rounds == sorted(rounds), key  # a pair's bytes flow in order
    sent: dict[tuple[int, int], int] = defaultdict(int)
    landed: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for p in schedule.pieces:
        assert p.slot == p.round % cfg.slots and p.slot_offset % cfg.align == 0, p
        assert 0 <= p.slot_offset and p.slot_offset + p.nbytes <= cfg.slot_bytes, p
        sent[(p.src, p.round)] += p.nbytes
        landed[(p.dst, p.round)].append((p.slot_offset, p.slot_offset + p.nbytes))
    assert all(n <= cfg.slot_bytes for n in sent.values())  # per-round send capacity
    for spans in landed.values():  # no two pieces share slot bytes in one round
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert schedule.rounds == max((p.round + 1 for p in schedule.pieces), default=0)
    assert schedule.lower_bound == lower_bound(messages, cfg.slot_bytes) <= schedule.rounds


def per_batch(messages: list[Message]) -> list[list[Message]]:
    """The runs of one refit: the executor submits one batch per ``run()``."""
    runs: dict[int, list[Message]] = defaultdict(list)
    for m in messages:
        runs[m.order].append(Message(m.src, m.dst, 0, m.nbytes))
    return [runs[k] for k in sorted(runs)]


@pytest.mark.parametrize("src_tp,dst_tp", [(4, 8), (8, 2)])
def test_realistic_64_ranks_2000_tensors(src_tp: int, dst_tp: int) -> None:
    messages = tp_dp_messages(world=64, src_tp=src_tp, dst_tp=dst_tp, n_tensors=2000, batches=4)
    cfg = StagingConfig()  # 2 x 64 MiB
    whole = build_schedule(messages, 64, cfg)
    check_schedule(whole, messages)
    print(
        f"\nTP{src_tp}->TP{dst_tp} x DP, 64 ranks, 2000 tensors, {len(messages)} messages, "
        f"{sum(m.nbytes for m in messages) / 2**30:.1f} GiB: {whole.rounds} rounds, "
        f"bound {whole.lower_bound}, ratio {whole.ratio:.3f}"
    )
    assert whole.ratio <= 1.05
    for run in per_batch(messages):
        sched = build_schedule(run, 64, cfg)
        check_schedule(sched, run)
        print(f"  batch: {sched.rounds} rounds, bound {sched.lower_bound}, ratio {sched.ratio:.3f}")
        assert sched.rounds <= sched.lower_bound + 1


def test_small_slots_fragment_little() -> None:
    messages = tp_dp_messages(world=64, src_tp=8, dst_tp=4, n_tensors=2000, batches=4)
    sched = build_schedule(messages, 64, StagingConfig(slot_bytes=16 * MiB, slots=2))
    check_schedule(sched, messages)
    print(f"\n16 MiB slots: {sched.rounds} rounds, bound {sched.lower_bound}, ratio {sched.ratio:.3f}")
    assert sched.ratio <= 1.05


def test_exact_small_schedule() -> None:
    # Two senders share receiver 2: 300 B each through 256 B slots. The pair with more bytes left
    # goes first (ties by rank): 0->2 fills round 0, 1->2 round 1, and both tails share round 2.
    cfg = StagingConfig(slot_bytes=256, slots=2, align=4, min_piece=1)
    msgs = [Message(0, 2, 0, 300), Message(1, 2, 0, 300)]
    sched = build_schedule(msgs, 3, cfg)
    assert sched.pieces == (
        Piece(round=0, src=0, dst=2, order=0, msg_offset=0, nbytes=256, slot=0, slot_offset=0),
        Piece(round=1, src=1, dst=2, order=0, msg_offset=0, nbytes=256, slot=1, slot_offset=0),
        Piece(round=2, src=0, dst=2, order=0, msg_offset=256, nbytes=44, slot=0, slot_offset=0),
        Piece(round=2, src=1, dst=2, order=0, msg_offset=256, nbytes=44, slot=0, slot_offset=44),
    )
    assert (sched.rounds, sched.lower_bound) == (3, 3)


def test_disjoint_pairs_share_rounds() -> None:
    # A ring: everyone sends and receives 3 slots' worth; every round every rank does both.
    cfg = StagingConfig(slot_bytes=1024, slots=2, align=1, min_piece=1)
    msgs = [Message(r, (r + 1) % 8, 0, 3 * 1024) for r in range(8)]
    sched = build_schedule(msgs, 8, cfg)
    check_schedule(sched, msgs)
    assert sched.rounds == sched.lower_bound == 3
    assert all(len(sched.sends_of(r)) == 3 and len(sched.recvs_of(r)) == 3 for r in range(8))


def test_pieces_stop_at_message_boundaries() -> None:
    cfg = StagingConfig(slot_bytes=1024, slots=2, align=256, min_piece=1)
    msgs = [Message(0, 1, 0, 100), Message(0, 1, 1, 0), Message(0, 1, 2, 700)]
    sched = build_schedule(msgs, 2, cfg)
    check_schedule(sched, msgs)
    assert [(p.order, p.nbytes, p.slot_offset) for p in sched.pieces] == [(0, 100, 0), (2, 700, 256)]


def test_empty_and_zero_byte_runs() -> None:
    assert build_schedule([], 4).rounds == 0
    sched = build_schedule([Message(0, 1, 0, 0)], 2)
    assert (sched.rounds, sched.pieces, sched.ratio) == (0, (), 1.0)


def test_cached_schedule_is_reused() -> None:
    msgs = (Message(0, 1, 0, 10), Message(1, 0, 0, 20))
    cfg = StagingConfig(slot_bytes=1024, slots=2)
    assert cached_schedule(msgs, 2, cfg) is cached_schedule(tuple(msgs), 2, cfg)
    assert cached_schedule(msgs, 2, cfg) is not cached_schedule(msgs[:1], 2, cfg)


@pytest.mark.parametrize(
    "msgs,world,error",
    [
        ([Message(0, 5, 0, 1)], 4, "outside [0, 4)"),
        ([Message(1, 1, 0, 1)], 4, "from a rank to itself"),
        ([Message(0, 1, 0, -1)], 4, "negative size"),
        ([Message(0, 1, 1, 8)], 4, "expected order index 0, got 1"),
        ([Message(0, 1, 0, 8), Message(0, 1, 0, 8)], 4, "expected order index 1, got 0"),
        ([], 0, "world size must be a positive integer"),
    ],
)
def test_bad_messages_raise_one_clear_error(msgs: list[Message], world: int, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_schedule(msgs, world)


def test_staging_config_from_arguments_and_env() -> None:
    assert StagingConfig.resolve(env={}) == StagingConfig(slot_bytes=64 * MiB, slots=2)
    env = {"RESHARD_NVSHMEM_SLOT_BYTES": "1048576", "RESHARD_NVSHMEM_SLOTS": "3"}
    assert StagingConfig.resolve(env=env) == StagingConfig(slot_bytes=MiB, slots=3)
    assert StagingConfig.resolve(slot_bytes=2 * MiB, env=env) == StagingConfig(slot_bytes=2 * MiB, slots=3)
    assert StagingConfig().total_bytes == 128 * MiB
    with pytest.raises(ValueError, match="RESHARD_NVSHMEM_SLOTS must be an integer"):
        StagingConfig.resolve(env={"RESHARD_NVSHMEM_SLOTS": "two"})
    with pytest.raises(ValueError, match="staging slots must be a positive integer, got 0"):
        StagingConfig(slots=0)
    with pytest.raises(ValueError, match="power of two dividing slot_bytes"):
        StagingConfig(slot_bytes=1000, align=256)


@settings(max_examples=150, deadline=None)
@given(transfer_sets())
def test_random_transfer_sets_keep_every_invariant(case) -> None:
    msgs, world, cfg = case
    check_schedule(build_schedule(msgs, world, cfg), msgs)


@settings(max_examples=150, deadline=None)
@given(transfer_sets(align=1, min_piece=1))
def test_greedy_is_within_twice_the_bound(case) -> None:
    # Byte-granular greedy is maximal: the last pair had a saturated end in every earlier round.
    msgs, world, cfg = case
    sched = build_schedule(msgs, world, cfg)
    assert sched.rounds <= 2 * sched.lower_bound + 1
