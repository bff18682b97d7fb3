"""The delta wire encoding (``reshard_core.execute.delta_codec``): exact round trips, and the sizes its
choices promise (position tokens, value-code widths, escapes)."""

from __future__ import annotations

import pytest
import torch

from reshard_core.execute import delta_codec as codec


def _changed(old: torch.Tensor, positions: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """``old`` with ``diffs`` added (16-bit wrap-around) at ``positions``."""
    new = old.clone()
    new[positions] = ((old[positions].to(torch.int32) + diffs + 32768) % 65536 - 32768).to(torch.int16)
    return new


def _round_trip(cur: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    payload = codec.encode(cur, old)
    delta = codec.decode(payload)
    out = old.clone()
    out[delta.positions] = delta.values(old[delta.positions])
    return payload, out


def _random_case(n: int, density: float, spread: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = torch.randint(-32768, 32768, (n,), dtype=torch.int32, generator=gen).to(torch.int16)
    positions = (torch.rand(n, generator=gen) < density).nonzero().squeeze(1)
    diffs = torch.randint(1, spread + 1, (positions.numel(),), generator=gen)
    diffs = torch.where(torch.rand(positions.numel(), generator=gen) < 0.5, diffs, -diffs)
    return _changed(old, positions, diffs), old


@pytest.mark.parametrize(
    "n, density, spread",
    [(1, 1.0, 1), (7, 0.0, 1), (1000, 0.01, 1), (100_000, 0.01, 2), (100_000, 0.3, 7), (50_000, 0.05, 100),
     (50_000, 0.5, 30000), (300_000, 0.0001, 1), (70_000, 1.0, 1)],
)  # fmt: skip
def test_every_word_comes_back_exactly(n, density, spread):
    cur, old = _random_case(n, density, spread, seed=n)
    payload, out = _round_trip(cur, old)
    assert torch.equal(out, cur)
    assert codec.payload_words(payload) == n


def test_unit_changes_at_one_percent_cost_under_one_and_a_half_bytes_per_changed_word():
    cur, old = _random_case(1_000_000, 0.01, 1, seed=1)
    payload, _ = _round_trip(cur, old)
    changed = int((cur != old).sum())
    assert (payload.numel() - codec.HEADER_BYTES) / changed < 1.4


def test_gaps_longer_than_a_byte_use_skip_tokens_and_sparse_messages_two_byte_tokens():
    old = torch.zeros(200_000, dtype=torch.int16)
    cur = _changed(
        old, torch.tensor([0, 254, 255, 510, 600, 70_000, 199_999]), torch.ones(7, dtype=torch.int32)
    )
    payload, out = _round_trip(cur, old)
    assert torch.equal(out, cur)
    k, tokens, mode, escapes, words = payload[: codec.HEADER_BYTES].view(torch.int64).tolist()
    assert (k, escapes, words) == (7, 0, 200_000)
    assert mode == 2 * 256 + 2  # two-byte tokens beat ~780 one-byte skips; every change is +1: 2 bits


def test_wide_changes_escape_whole_words_and_sign_flips_survive():
    old = torch.tensor([1, -1, 0x7FFF, -0x8000, 100, 5] * 200, dtype=torch.int16)
    cur = old.clone()
    cur[0::6] = -2  # 1 -> -2
    cur[1::6] = 1  # -1 -> 1
    cur[2::6] = -0x8000  # wraps by one
    cur[3::6] = 0x7FFF  # wraps by one the other way
    cur[4::6] = 30000  # far
    payload, out = _round_trip(cur, old)
    assert torch.equal(out, cur)
    k, _, mode, escapes, _ = payload[: codec.HEADER_BYTES].view(torch.int64).tolist()
    assert k == 1000 and mode % 256 == 4 and escapes == 200  # codes for ±1..±3, the far jumps escaped


def test_no_change_is_a_header_alone():
    old = torch.arange(5000, dtype=torch.int16)
    payload, out = _round_trip(old.clone(), old)
    assert payload.numel() == codec.HEADER_BYTES and torch.equal(out, old)


def test_the_lower_bound_never_exceeds_a_real_encoding():
    for density, spread in [(0.001, 1), (0.01, 1), (0.2, 3), (0.9, 1000)]:
        cur, old = _random_case(20_000, density, spread, seed=int(density * 1000))
        assert codec.lower_bound(int((cur != old).sum())) <= codec.encode(cur, old).numel()


@pytest.mark.parametrize("offset", [0, 1])  # aligned 8-byte blocks, and single words
def test_a_scan_lists_exactly_the_changed_words(offset):
    cur, old = _random_case(40_001, 0.03, 3, seed=5)
    cur, old = cur[offset : offset + 40_000], old[offset : offset + 40_000]
    scan = codec.Scan(cur, old)
    assert scan.width == (4 if offset == 0 else 1)
    changes = scan.changes()
    want = (cur != old).nonzero().squeeze(1)
    assert torch.equal(changes.positions, want)
    assert torch.equal(changes.new, cur[want]) and torch.equal(changes.old, old[want])
    assert scan.blocks <= want.numel() <= scan.blocks * scan.width


@pytest.mark.parametrize("kind", ["contiguous", "strided", "split", "bytes"])
def test_a_delta_lands_in_every_kind_of_destination_region(kind):
    """``delta_land._write_words`` on a plain contiguous region, a strided one (a column block), a split
    region (Megatron's q rows inside ``linear_qkv``) and a strided uint8 region (through a copy):
    the region's words become the new ones, nothing else of the base changes."""
    from reshard_core.execute import delta_land as deltas
    from reshard_core.execute.slots import Slot
    from reshard_core.views import SplitView, materialize, region

    gen = torch.Generator().manual_seed(2)
    if kind == "split":  # 2 groups of [q: 4 rows; k: 1; v: 1] x 8 columns; the logical q rows 2..6
        base = torch.randn(2, 6, 8, generator=gen).to(torch.bfloat16)
        target = region(SplitView(base[:, :4], [(2, 4), (8,)]), (2, 0), (4, 8))
        inside = (slice(None), slice(0, 4))  # covers the region (and q rows outside it)
    elif kind == "bytes":
        base = torch.randint(0, 256, (16, 10), generator=gen, dtype=torch.int32).to(torch.uint8)
        inside = (slice(None), slice(2, 6))
        target = base[inside]
    else:
        base = torch.randn(16, 12, generator=gen).to(torch.bfloat16)
        inside = (slice(4, 10),) if kind == "contiguous" else (slice(None), slice(3, 7))
        target = base[inside]
    before = materialize(target).clone()
    words = before.reshape(-1).view(torch.uint8).view(torch.int16).clone()
    new = words.clone()
    new[::3] += 1
    new[1::7] -= 300
    delta = codec.decode(codec.encode(new, words))
    untouched = base.clone()
    deltas._write_words(target, Slot(0, tuple(before.shape), before.dtype), delta.positions, delta, 0)
    assert torch.equal(materialize(target).reshape(-1).view(torch.uint8).view(torch.int16), new)
    outside = torch.ones(base.shape, dtype=torch.bool)
    outside[inside] = False
    assert torch.equal(base[outside], untouched[outside])
