"""Delta refits on declared layouts in one 4-rank Gloo world (``reshard_core.execute.delta``).

- TP2 → TP4 with row and column shards (strided destination regions), a replicated tensor into
  shards, small BF16/FP32/uint8 tensors packed into one message (under ``MIN_BYTES`` or of a 1-byte
  dtype: always whole), sources changed sparsely between refits: every destination exact after
  every refit, through ``refit`` and through a prepared ``Session.refit()``;
- ``verify=True`` together with ``delta=True``: every arrival checked, none differs;
- another session writing the same destinations between two delta refits: the next delta refit is
  full for them, and exact;
- ranks passing different ``delta``: one ``ReshardError`` on every rank naming the option.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
ALL = (0, 1, 2, 3)
SRC = [
    ("w", (1024, 256), BF16, (0, 1), 0),
    ("proj", (96, 512), BF16, (0, 1), 1),
    ("emb", (512, 64), BF16, (0,), None),
    ("n.a", (7,), BF16, (0,), None),
    ("n.b", (300,), F32, (0,), None),
    ("n.c", (2048,), U8, (0,), None),
]
DST = [
    ("w", (1024, 256), BF16, ALL, 1),
    ("proj", (96, 512), BF16, ALL, 0),
    ("emb", (512, 64), BF16, ALL, 1),
    ("n.a", (7,), BF16, (1, 2, 3), None),
    ("n.b", (300,), F32, (1, 2, 3), None),
    ("n.c", (2048,), U8, (1, 2, 3), None),
]
STEPS = 5


def _full(name: str, shape, dtype: torch.dtype, step: int) -> torch.Tensor:
    """The global tensor ``name`` after ``step`` sparse updates (the same in every process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == U8:
        x = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
        for _ in range(step):
            x = torch.where(torch.rand(shape, generator=gen) < 0.02, (x + 1) % 256, x)
        return x.to(U8)
    x = torch.randn(shape, generator=gen)
    for _ in range(step):
        x = x * (1 + 0.02 * (torch.rand(shape, generator=gen) < 0.02))
    return x.to(dtype)


def _piece(spec, rank: int, step: int) -> torch.Tensor:
    name, shape, dtype, ranks, dim = spec
    full = _full(name, shape, dtype, step)
    return full if dim is None else full.chunk(len(ranks), dim)[ranks.index(rank)].clone()


def _module(rank: int, specs, step: int | None) -> nn.Module | None:
    """This rank's side of ``specs`` at ``step`` (None: zeroed), parameters named by their specs."""
    from reshard_core import declare_layout

    module = nn.Module()
    for i, spec in enumerate(specs):
        name, shape, _, ranks, dim = spec
        if rank in ranks:
            piece = _piece(spec, rank, step or 0)
            param = nn.Parameter(piece if step is not None else torch.zeros_like(piece), requires_grad=False)
            declare_layout(param, dim=dim, ranks=ranks, name=name, shape=shape)
            module.register_parameter(f"p{i}", param)
    return module if len(module._parameters) else None


def _advance(rank: int, src: nn.Module | None, step: int) -> None:
    if src is not None:
        for i, spec in enumerate(SRC):
            if rank in spec[3]:
                getattr(src, f"p{i}").data.copy_(_piece(spec, rank, step))


def _wrong(rank: int, dst: nn.Module | None, step: int) -> list[str]:
    if dst is None:
        return []
    return [
        spec[0] for i, spec in enumerate(DST)
        if rank in spec[3] and not torch.equal(getattr(dst, f"p{i}"), _piece(spec, rank, step))
    ]  # fmt: skip


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.coordination import failures
    from reshard_core.errors import ReshardError

    out: dict = {"refit": [], "session": [], "verify": []}
    src, dst = _module(rank, SRC, 0), _module(rank, DST, None)
    for step in range(STEPS):
        _advance(rank, src, step)
        report = reshard_core.refit(src, dst, delta=True, timeout=20)
        out["refit"].append((_wrong(rank, dst, step), report.bytes_sent, report.delta))

    src2, dst2 = _module(rank, SRC, 0), _module(rank, DST, None)
    session = reshard_core.prepare(src2, dst2, delta=True, timeout=20)
    for step in range(STEPS):
        _advance(rank, src2, step)
        report = session.refit()
        out["session"].append((_wrong(rank, dst2, step), report.bytes_sent, report.delta))

    src3, dst3 = _module(rank, SRC, 0), _module(rank, DST, None)
    for step in range(3):
        _advance(rank, src3, step)
        report = reshard_core.refit(src3, dst3, delta=True, verify=True, timeout=20)
        out["verify"].append((_wrong(rank, dst3, step), report.verified_bytes, report.delta.messages))

    # another session (another source model) writes dst between two delta refits
    other = _module(rank, SRC, 7)
    reshard_core.refit(other, dst, timeout=20)
    _advance(rank, src, STEPS)
    report = reshard_core.refit(src, dst, delta=True, timeout=20)
    out["rewritten"] = (_wrong(rank, dst, STEPS), report.delta)

    try:
        reshard_core.refit(src, dst, delta=rank != 2, timeout=20)
        out["mismatch"] = "ok"
    except ReshardError as exc:
        with failures.watched(None):
            pass
        out["mismatch"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 4, timeout=300)


@pytest.mark.parametrize("path", ["refit", "session"])
def test_every_delta_refit_is_exact_and_after_the_first_moves_a_fraction(runs, path):
    for rank, out in enumerate(runs):
        records = out[path]
        assert [wrong for wrong, _, _ in records] == [[]] * STEPS, (rank, path)
        sent = [s for _, s, _ in records]
        stats = [d for _, _, d in records]
        if rank in (0, 1):  # the senders
            assert stats[0].messages == 0 and sent[0] == stats[0].full_bytes
            assert "first delta refit of this plan" in stats[0].note
            later = zip(sent[1:], stats[1:], strict=True)
            assert all(d.messages > 0 and s < d.full_bytes / 4 for s, d in later), records
            assert stats[-1].held_bytes > 0 and stats[-1].changed_words < stats[-1].compared_words / 20


def test_verify_checks_every_delta_arrival(runs):
    for out in runs:
        assert [wrong for wrong, _, _ in out["verify"]] == [[]] * 3
    assert all(bytes_ > 0 for out in runs[1:] for _, bytes_, _ in out["verify"])
    assert any(messages > 0 for out in runs for _, _, messages in out["verify"][1:])


def test_destinations_written_by_another_session_get_the_next_delta_refit_whole(runs):
    for rank, out in enumerate(runs):
        wrong, stats = out["rewritten"]
        assert wrong == []
        if rank in (0, 1):
            assert stats.messages == 0, stats
            assert "holds no baseline" in stats.note, stats.note


def test_ranks_passing_different_delta_all_fail_naming_it(runs):
    want = (
        "refit options differ across ranks: delta (ranks [0, 1, 3] vs ranks [2]); every rank must pass "
        "the same ignore=, tied=, max_batch_bytes=, transport=, cast=, verify= and delta= (they shape the "
        "plan and its execution)"
    )
    assert [out["mismatch"] for out in runs] == [want] * 4
