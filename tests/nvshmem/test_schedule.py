"""The NVSHMEM schedule: exact delivery, no slot conflicts, per-round loads, rounds at the bound."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from nvshmem_patterns import tp_dp_messages, transfer_sets
from reshard_nvshmem.schedule import (
    Message,
    Piece,
    Schedule,
    Share,
    StagingConfig,
    build_schedule,
    lower_bound,
    receiver_layout,
    sender_pieces,
)

MiB = 1 << 20


def round_loads(schedule: Schedule) -> tuple[dict, dict]:
    """Bytes each rank sends, resp. receives, in each round: ``{(rank, round): bytes}``."""
    sent: dict[tuple[int, int], int] = defaultdict(int)
    received: dict[tuple[int, int], int] = defaultdict(int)
    for p in schedule.pieces:
        sent[(p.src, p.round)] += p.nbytes
        received[(p.dst, p.round)] += p.nbytes
    return sent, received


def lockstep_rounds(schedule: Schedule) -> float:
    """Rounds if every round took as long as its busiest rank (sending or receiving), in slots."""
    sent, received = round_loads(schedule)
    busiest: dict[int, int] = defaultdict(int)
    for (_, t), n in (*sent.items(), *received.items()):
        busiest[t] = max(busiest[t], n)
    return sum(busiest.values()) / schedule.config.slot_bytes


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
            cursor += p.nbytes
        assert cursor == nbytes, key
        rounds = [p.round for p in pieces]
        assert rounds == sorted(rounds), key  # a pair's bytes flow in order
    landed: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for p in schedule.pieces:
        assert p.slot == p.round % cfg.slots, p
        assert 0 <= p.slot_offset and p.slot_offset + p.nbytes <= cfg.slot_bytes, p
        landed[(p.dst, p.round)].append((p.slot_offset, p.slot_offset + p.nbytes))
    for spans in landed.values():  # no two pieces share slot bytes in one round
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    pair_sizes: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in sorted(messages):
        pair_sizes[(m.src, m.dst)].append(m.nbytes)
    for dst, layout in schedule.layouts.items():  # aligned regions; senders derive the same pieces
        assert all(share.offset % cfg.align == 0 for share in layout.shares.values())
        theirs: dict[int, list[Piece]] = defaultdict(list)
        for p in layout.pieces:
            theirs[p.src].append(p)
        for src, share in layout.shares.items():
            assert sender_pieces(src, dst, pair_sizes[(src, dst)], share, cfg) == tuple(theirs[src])
    receivers: dict[int, set[int]] = defaultdict(set)
    for m in messages:
        receivers[m.src].add(m.dst)
    sent, _ = round_loads(schedule)
    for (src, _), n in sent.items():  # per round a rank sends about one slot (rounding, floors)
        assert n <= cfg.slot_bytes + len(receivers[src]) * min(cfg.min_piece, cfg.slot_bytes), (src, n)
    assert schedule.rounds == max((p.round + 1 for p in schedule.pieces), default=0)
    assert schedule.lower_bound == lower_bound(messages, cfg.slot_bytes)
    assert schedule.rounds >= math.ceil(heaviest(messages, ("dst",)) / cfg.slot_bytes)  # one slot a round


def heaviest(messages: list[Message], sides: tuple[str, ...] = ("src", "dst")) -> int:
    """The most bytes one rank sends or receives (over ``sides``)."""
    load: dict[tuple[str, int], int] = defaultdict(int)
    for m in messages:
        for side in sides:
            load[(side, getattr(m, side))] += m.nbytes
    return max(load.values(), default=0)


def per_batch(messages: list[Message]) -> list[list[Message]]:
    """The runs of one refit: the executor submits one batch per ``run()``."""
    runs: dict[int, list[Message]] = defaultdict(list)
    for m in messages:
        runs[m.order].append(Message(m.src, m.dst, 0, m.nbytes))
    return [runs[k] for k in sorted(runs)]


@pytest.mark.parametrize("src_tp,dst_tp,runs", [(4, 8, 4), (8, 2, 4), (8, 1, 1)])
def test_realistic_64_ranks_2000_tensors(src_tp: int, dst_tp: int, runs: int) -> None:
    messages = tp_dp_messages(world=64, src_tp=src_tp, dst_tp=dst_tp, n_tensors=2000, batches=4)
    cfg = StagingConfig()  # 2 x 64 MiB
    print(
        f"\nTP{src_tp}->TP{dst_tp} x DP, 64 ranks, 2000 tensors, {len(messages)} messages, "
        f"{sum(m.nbytes for m in messages) / 2**30:.1f} GiB in 4 runs (batches):"
    )
    for run in per_batch(messages)[:runs]:  # TP8->TP1 (56 senders per receiver): one run is plenty
        sched = build_schedule(run, 64, cfg)
        check_schedule(sched, run)
        exact = heaviest(run) / cfg.slot_bytes
        peak = max(n for loads in round_loads(sched) for n in loads.values()) / cfg.slot_bytes
        lockstep = lockstep_rounds(sched)
        print(
            f"  {sched.rounds} rounds, bound {sched.lower_bound} ({exact:.2f} slots), "
            f"ratio {sched.ratio:.3f}; "
            f"lockstep {lockstep:.2f} slots ({lockstep / exact:.3f}x); busiest round {peak:.3f} slot"
        )
        assert sched.rounds == sched.lower_bound
        assert lockstep <= 1.02 * exact
        assert peak <= 1.0


def test_small_slots_stay_at_the_bound() -> None:
    run = per_batch(tp_dp_messages(world=64, src_tp=8, dst_tp=4, n_tensors=2000, batches=4))[0]
    sched = build_schedule(run, 64, StagingConfig(slot_bytes=16 * MiB, slots=2))
    check_schedule(sched, run)
    print(f"\n16 MiB slots: {sched.rounds} rounds, bound {sched.lower_bound}, ratio {sched.ratio:.3f}")
    assert sched.rounds == sched.lower_bound


def test_exact_small_schedule() -> None:
    # Receiver 2 takes 300 B from each of ranks 0 and 1 through 256 B slots: 3 rounds, each sender
    # gets a 100 B region (rank 0 first: receivers start at the sender after themselves).
    cfg = StagingConfig(slot_bytes=256, slots=2, align=4, min_piece=1)
    sched = build_schedule([Message(0, 2, 0, 300), Message(1, 2, 0, 300)], 3, cfg)
    assert sched.layouts[2].shares == {0: Share(0, 100), 1: Share(100, 100)}
    assert sched.pieces == tuple(
        Piece(round=t, src=src, dst=2, order=0, msg_offset=100 * t, nbytes=100, slot=t % 2, slot_offset=100 * src)  # noqa: E501
        for t in range(3)
        for src in (0, 1)
    )
    assert (sched.rounds, sched.lower_bound) == (3, 3)


def test_a_busy_sender_is_spread_over_its_own_rounds() -> None:
    # Rank 0 sends 512 B to each of ranks 1 and 2: it needs 4 rounds of 256 B, so each receiver
    # takes 128 B a round from it (not 256 B in 2 rounds, which would ask rank 0 for 512 B a round).
    cfg = StagingConfig(slot_bytes=256, slots=2, align=1, min_piece=1)
    msgs = [Message(0, 1, 0, 512), Message(0, 2, 0, 512)]
    sched = build_schedule(msgs, 3, cfg)
    check_schedule(sched, msgs)
    assert sched.layouts[1].shares == {0: Share(0, 128)} and sched.layouts[2].shares == {0: Share(0, 128)}
    sent, _ = round_loads(sched)
    assert dict(sent) == {(0, t): 256 for t in range(4)}
    assert sched.rounds == sched.lower_bound == 4


def test_everyone_sends_and_receives_every_round() -> None:
    # A ring with 3 slots' worth per rank: 3 rounds, each rank sending and receiving in all of them.
    cfg = StagingConfig(slot_bytes=1024, slots=2, align=1, min_piece=1)
    msgs = [Message(r, (r + 1) % 8, 0, 3 * 1024) for r in range(8)]
    sched = build_schedule(msgs, 8, cfg)
    check_schedule(sched, msgs)
    assert sched.rounds == sched.lower_bound == 3
    sent, received = round_loads(sched)
    assert set(sent) == set(received) == {(r, t) for r in range(8) for t in range(3)}


def test_pieces_stop_at_message_boundaries() -> None:
    cfg = StagingConfig(slot_bytes=1024, slots=2, align=256, min_piece=1)
    msgs = [Message(0, 1, 0, 100), Message(0, 1, 1, 0), Message(0, 1, 2, 700)]
    sched = build_schedule(msgs, 2, cfg)
    check_schedule(sched, msgs)
    pieces = [(p.order, p.msg_offset, p.nbytes, p.slot_offset) for p in sched.pieces]
    assert pieces == [(0, 0, 100, 0), (2, 0, 700, 100)]


def test_empty_and_zero_byte_runs() -> None:
    assert build_schedule([], 4).rounds == 0
    sched = build_schedule([Message(0, 1, 0, 0)], 2)
    assert (sched.rounds, sched.pieces, sched.ratio) == (0, (), 1.0)


def test_layouts_are_memoised_per_plan_signature() -> None:
    cfg = StagingConfig(slot_bytes=1024, slots=2)
    first = receiver_layout(1, ((0, 10), (2, 20)), ((0, 10), (2, 20)), 3, cfg)
    assert receiver_layout(1, ((0, 10), (2, 20)), ((0, 10), (2, 20)), 3, cfg) is first
    assert receiver_layout(1, ((0, 10), (2, 21)), ((0, 10), (2, 21)), 3, cfg) is not first


def test_too_many_senders_for_a_slot_is_one_clear_error() -> None:
    cfg = StagingConfig(slot_bytes=512, slots=2, align=256, min_piece=1)
    msgs = [Message(src, 0, 0, 1000) for src in (1, 2, 3)]
    with pytest.raises(ValueError, match="slots cannot hold one 256-byte region for each of 3 senders"):
        build_schedule(msgs, 4, cfg)


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
def test_rounds_stay_near_the_bound(case) -> None:
    # Byte-granular shares round up by < 1 B per sender, so a receiver's own rounds never exceed
    # ceil(incoming / (slot - senders)), and a pair is stretched only to its sender's rounds.
    msgs, world, cfg = case
    sched = build_schedule(msgs, world, cfg)
    assert sched.rounds <= max(1, math.ceil(heaviest(msgs) / (cfg.slot_bytes - (world - 1))))
