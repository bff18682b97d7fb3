"""``refit(..., verify=True)`` on a real 4-rank Gloo world: exact results with every byte checked, and
corruption caught and named on every rank (``reshard_core.execute.verify``).

One spawned world runs every scenario in turn (spawning costs seconds):

- layouts: TP2 → TP4 (row and column shards, local copies, 256 KiB slices sent unstaged),
  replicated → sharded, ``cast=True`` (fp32 → bf16), a ``max_batch_bytes`` that forces one batch
  per tensor, packed small slices of mixed dtypes (slot padding); each refit twice (new plan, then
  the cached one): exact, and ``verified_bytes == bytes_received + bytes_local``;
- a test transport (``CorruptingGloo``) flipping one bit of chosen received messages after they
  land: silent without ``verify`` (the destinations are wrong), a ``ReshardError`` with the same
  text on every rank with it, naming the tensors and the rank pairs;
- a corrupted local copy (``executor.run_local`` patched on rank 0), silent vs caught;
- a transformed tensor (``Doubling``: the destination is twice the wire data): verified on its wire
  bytes (passes although the destination bytes differ from them), corruption of its wire caught.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from reshard_gloo.transport import GlooCopyService
from torch import nn

from reshard_core.errors import ReshardError
from reshard_core.testing.world import run_world
from reshard_core.transform import ReshardTransform
from reshard_core.views import region

pytestmark = pytest.mark.slow

F32, BF16 = torch.float32, torch.bfloat16
ALL, DST3 = (0, 1, 2, 3), (1, 2, 3)
TIMEOUT = 30.0

Spec = tuple[str, tuple[int, ...], torch.dtype, tuple[int, ...], int | None]
"""``(name, global shape, dtype, ranks, shard dim or None for replicated)``."""

LAYOUTS: dict[str, tuple[list[Spec], list[Spec], dict]] = {  # name: (sources, destinations, refit options)
    "tp2->tp4": (
        [("w", (1024, 256), F32, (0, 1), 0), ("proj", (64, 48), BF16, (0, 1), 1)],
        [("w", (1024, 256), F32, ALL, 0), ("proj", (64, 48), BF16, ALL, 1)],
        {},
    ),
    "replicated->sharded": (
        [("emb", (96, 40), BF16, (0, 1), None)],
        [("emb", (96, 40), BF16, ALL, 1)],
        {},
    ),
    "cast fp32->bf16": (
        [("r", (32, 8), F32, (0, 1), 0)],
        [("r", (32, 8), BF16, ALL, 0)],
        {"cast": True},
    ),
    "one batch per tensor": (
        [(f"b{i}", (64, 32), F32, (0,), None) for i in range(5)],
        [(f"b{i}", (64, 32), F32, ALL, 0) for i in range(5)],
        {"max_batch_bytes": 64 * 32 * 4},
    ),
    "packed small slices": (
        [("n.a", (7,), BF16, (0,), None), ("n.b", (5,), F32, (0,), None), ("n.c", (6, 3), BF16, (0,), None)],
        [("n.a", (7,), BF16, DST3, None), ("n.b", (5,), F32, DST3, None), ("n.c", (6, 3), BF16, DST3, 1)],
        {},
    ),
}

# rank 0 sends everything; each destination rank gets 256-row (256 KiB) slices of the layers, each a
# message of its own, and both norms in one packed message
CORRUPTED_SRC: list[Spec] = [
    ("layers.0.w", (768, 256), F32, (0,), None),
    ("layers.1.w", (768, 256), F32, (0,), None),
    ("norm.a", (16,), F32, (0,), None),
    ("norm.b", (10,), BF16, (0,), None),
]
CORRUPTED_DST: list[Spec] = [
    ("layers.0.w", (768, 256), F32, DST3, 0),
    ("layers.1.w", (768, 256), F32, DST3, 0),
    ("norm.a", (16,), F32, DST3, None),
    ("norm.b", (10,), BF16, DST3, None),
]
FLIPS = {2: "large", 3: "small"}  # receiving rank: which data messages from rank 0 get a bit flipped
CORRUPTED_TEXT = (
    "verify: rank 0 → rank 2: 2 tensors arrived different from what was sent: layers.0.w, layers.1.w; "
    "rank 0 → rank 3: 1 tensor arrived different from what was sent: norm.a"
)
LOCAL = ([("w", (64, 16), F32, (0, 1), 0)], [("w", (64, 16), F32, ALL, 0)])
LOCAL_TEXT = "verify: rank 0 → rank 0 (local copies): 1 tensor arrived different from the source: w"
TRANSFORMED = (
    [("t", (48, 32), F32, (0,), None), ("u", (8,), F32, (0,), None)],
    [("t", (48, 32), F32, DST3, 0), ("u", (8,), F32, DST3, None)],
)
TRANSFORMED_TEXT = "verify: rank 0 → rank 1: 1 tensor arrived different from what was sent: t"


def _full(name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The global tensor ``name`` (the same values in every process; fp32 rounded to ``dtype``)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def _piece(spec: Spec, rank: int) -> torch.Tensor:
    """This rank's piece of the global tensor of ``spec``."""
    name, shape, dtype, ranks, dim = spec
    full = _full(name, shape, dtype)
    return full if dim is None else full.chunk(len(ranks), dim)[ranks.index(rank)].clone()


def _module(rank: int, specs: list[Spec], fill: bool) -> nn.Module | None:
    """This rank's model of one side (None when it holds none of ``specs``); sources filled,
    destinations zeroed. Parameters are declared under the specs' names."""
    from reshard_core import declare_layout

    module = nn.Module()
    for i, spec in enumerate(specs):
        name, shape, _, ranks, dim = spec
        if rank in ranks:
            piece = _piece(spec, rank)
            param = nn.Parameter(piece if fill else torch.zeros_like(piece), requires_grad=False)
            declare_layout(param, dim=dim, ranks=ranks, name=name, shape=shape)
            module.register_parameter(f"p{i}", param)
    return module if len(module._parameters) else None


def _wrong(rank: int, specs: list[Spec], dst: nn.Module | None) -> list[str]:
    """The destination tensors of this rank that differ from the source."""
    if dst is None:
        return []
    params = dict(dst.named_parameters())
    held = [(i, spec) for i, spec in enumerate(specs) if rank in spec[3]]
    return [spec[0] for i, spec in held if not torch.equal(params[f"p{i}"], _piece(spec, rank))]


class CorruptingGloo(GlooCopyService):
    """Gloo that flips one bit (of the first byte) of chosen received data messages once they
    landed: ``flips`` maps a receiving rank to the messages from rank 0 hit there, ``"large"`` (at
    least 256 KiB) or ``"small"``. Only batch 0's (the task id's top bits): the digests that cross
    after the last batch are left alone."""

    def __init__(self, *args, flips: dict[int, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.flips = flips
        self.flipped = 0

    def _finish(self, ops):
        super()._finish(ops)
        want = self.flips.get(self.rank)
        for op in ops:
            if op.kind != "recv" or op.peer != 0 or op.task_id >> 60 != 0 or want is None:
                continue
            if (op.tensor.nbytes >= 256 * 1024) == (want == "large"):
                data = op.tensor.reshape(-1).view(torch.uint8)
                data[0] ^= 0x10
                self.flipped += 1


class Doubling(ReshardTransform):
    """Owns ``t``: sends the fp32 region and its amax (two wire tensors per op) and lands twice the
    data in the destination parameter, so the destination bytes are not the wire bytes."""

    def __init__(self, dst: nn.Module | None):
        self.dst = dict(dst.named_parameters()) if dst is not None else {}

    def should_transform(self, name):
        return name == "t"

    def prepare_send(self, name, op, src_view):
        return [src_view.contiguous(), src_view.abs().amax().reshape(1)]

    def prepare_recv(self, name, op):
        return [torch.empty(op.sizes, dtype=F32), torch.empty(1, dtype=F32)]

    def finalize_recv(self, name, op, buffers):
        region(self.dst["p0"], op.dst_local, op.sizes).copy_(buffers[0] * 2)


def _counts(report) -> dict:
    keys = ("verified_bytes", "verified_messages", "bytes_received", "bytes_local", "messages", "batches")
    return {k: getattr(report, k) for k in keys} | {"reused": report.reused_plan}


def _caught(call) -> str | None:
    """Run a refit; return its ``ReshardError`` text, or None. After an error this rank's failure
    record is taken down and every rank meets, so the next refit starts clean."""
    from reshard_core.coordination import failures

    try:
        call()
    except ReshardError as exc:
        with failures.watched(None):  # takes this rank's record of the error down
            pass
        dist.barrier()
        return str(exc)
    return None


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.execute import executor

    out: dict = {"layouts": {}}
    for case, (src_specs, dst_specs, options) in LAYOUTS.items():
        src, dst = _module(rank, src_specs, True), _module(rank, dst_specs, False)
        runs = [reshard_core.refit(src, dst, verify=True, timeout=TIMEOUT, **options) for _ in range(2)]
        plain = reshard_core.refit(src, dst, timeout=TIMEOUT, **options)
        out["layouts"][case] = {
            "wrong": _wrong(rank, dst_specs, dst),
            "runs": [_counts(r) for r in runs],
            "unverified": (plain.verified_bytes, plain.verified_messages),
        }

    transport = CorruptingGloo(timeout=TIMEOUT, flips=FLIPS)
    src, dst = _module(rank, CORRUPTED_SRC, True), _module(rank, CORRUPTED_DST, False)
    silent = _caught(lambda: reshard_core.refit(src, dst, transport=transport, timeout=TIMEOUT))
    silent_wrong = _wrong(rank, CORRUPTED_DST, dst)
    dst = _module(rank, CORRUPTED_DST, False)
    caught = _caught(lambda: reshard_core.refit(src, dst, transport=transport, timeout=TIMEOUT, verify=True))
    out["corrupted"] = {"silent": silent, "silent_wrong": silent_wrong, "caught": caught}
    out["corrupted"]["flips"] = transport.flipped

    original = executor.run_local

    def corrupting_local(ctx, op):  # rank 0's local copy of w comes out one element off
        nbytes = original(ctx, op)
        view = ctx.dst_view(op)
        view[(0,) * view.dim()] += 1
        return nbytes

    if rank == 0:
        executor.run_local = corrupting_local
    src, dst = _module(rank, LOCAL[0], True), _module(rank, LOCAL[1], False)
    silent = _caught(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))
    silent_wrong = _wrong(rank, LOCAL[1], dst)
    dst = _module(rank, LOCAL[1], False)
    caught = _caught(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT, verify=True))
    executor.run_local = original
    out["local"] = {"silent": silent, "silent_wrong": silent_wrong, "caught": caught}

    src, dst = _module(rank, TRANSFORMED[0], True), _module(rank, TRANSFORMED[1], False)
    report = reshard_core.refit(src, dst, transform=Doubling(dst), timeout=TIMEOUT, verify=True)
    doubled = dst is None or torch.equal(dst.p0, 2 * _piece(TRANSFORMED[1][0], rank))
    corrupting = CorruptingGloo(timeout=TIMEOUT, flips={1: "small"})  # t's data leads the message
    dst = _module(rank, TRANSFORMED[1], False)
    transform = Doubling(dst)
    options = {"transport": corrupting, "transform": transform, "timeout": TIMEOUT, "verify": True}
    caught = _caught(lambda: reshard_core.refit(src, dst, **options))
    out["transformed"] = {"counts": _counts(report), "doubled": doubled, "caught": caught}
    transport.close()
    corrupting.close()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_world(_world, 4, timeout=240, pg_timeout=120)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_verified_refits_are_exact_and_count_every_byte_they_checked(world, case):
    for rank, result in enumerate(world):
        found = result["layouts"][case]
        assert found["wrong"] == [], f"rank {rank}"
        for run, counts in enumerate(found["runs"]):
            assert counts["reused"] == (run == 1)
            assert counts["verified_bytes"] == counts["bytes_received"] + counts["bytes_local"], rank
        assert found["unverified"] == (0, 0)
    for run in (0, 1):
        runs = [result["layouts"][case]["runs"][run] for result in world]
        assert sum(c["verified_messages"] for c in runs) == sum(c["messages"] for c in runs)  # each, once
        assert sum(c["verified_bytes"] for c in runs) > 0


def test_the_layouts_take_the_paths_they_are_meant_to(world):
    """The scenarios above do cover local copies, several batches and packed messages."""
    tp = world[0]["layouts"]["tp2->tp4"]["runs"][0]
    assert tp["bytes_local"] > 0 and tp["bytes_received"] == 0  # rank 0 holds w's rows 0-511
    assert max(r["layouts"]["one batch per tensor"]["runs"][0]["batches"] for r in world) == 5
    packed = world[1]["layouts"]["packed small slices"]["runs"][0]
    assert packed["verified_messages"] == 1  # three tensors in one message, padding included
    assert packed["verified_bytes"] == 14 + 2 + 20 + 2 * 6 * 1  # n.a, pad to 4, n.b, n.c's column


def test_corrupted_messages_pass_silently_without_verify(world):
    for rank, result in enumerate(world):
        found = result["corrupted"]
        assert found["silent"] is None
        assert found["silent_wrong"] == {2: ["layers.0.w", "layers.1.w"], 3: ["norm.a"]}.get(rank, [])
        assert found["flips"] == {2: 4, 3: 2}.get(rank, 0)  # two refits


def test_corrupted_messages_are_named_on_every_rank_with_verify(world):
    assert [result["corrupted"]["caught"] for result in world] == [CORRUPTED_TEXT] * 4


def test_a_corrupted_local_copy_is_named_on_every_rank_with_verify(world):
    for rank, result in enumerate(world):
        assert result["local"]["silent"] is None
        assert result["local"]["silent_wrong"] == (["w"] if rank == 0 else [])
    assert [result["local"]["caught"] for result in world] == [LOCAL_TEXT] * 4


def test_a_transformed_tensor_is_verified_on_its_wire_bytes(world):
    for rank, result in enumerate(world):
        found = result["transformed"]
        assert found["doubled"], f"rank {rank}: the transform's landing is not what verify let through"
        counts = found["counts"]
        assert counts["verified_bytes"] == counts["bytes_received"] + counts["bytes_local"]
        assert counts["verified_messages"] == (1 if rank else 0)
    assert [result["transformed"]["caught"] for result in world] == [TRANSFORMED_TEXT] * 4


def test_ranks_that_disagree_on_verify_are_told_before_any_data_moves():
    from reshard_core import RefitOptions
    from reshard_core.exchange.option_digests import check_options, option_digests

    on, off = option_digests(RefitOptions(verify=True)), option_digests(RefitOptions())
    with pytest.raises(ReshardError) as info:
        check_options({0: on, 1: off, 2: on})
    want = "refit options differ across ranks: verify (ranks [0, 2] vs ranks [1]);"
    assert str(info.value).startswith(want)
