"""The executor on real Gloo worlds: plans from ``plan_rank``, every destination byte vs the source.

One spawned 4-rank world runs every colocated scenario (spawning costs seconds); failure scenarios
(a stalled rank, a killed rank) get their own 3-rank worlds.
"""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch
import torch.distributed as dist
from reshard_gloo.transport import GlooCopyService

from reshard_core.errors import TransportError
from reshard_core.execute import StagingPool, execute_plan
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.ops import OpKind
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import TableBuilder
from reshard_core.specs import TensorMeta
from reshard_core.testing.conformance import same_bytes
from reshard_core.testing.world import WorldError, run_world
from reshard_core.transform import ReshardTransform
from reshard_core.views import region

pytestmark = pytest.mark.slow

BF16, F32, F8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
TP2, TP4 = (0, 1), (0, 1, 2, 3)


def lay(ranks, *placements) -> Layout:
    return Layout(Mesh.of(ranks), tuple(placements) or (Replicate(),))


MIXED = [  # (name, shape, dtype, source layouts, destination layouts)
    ("qkv", (16, 6), BF16, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
    ("fc1", (16, 6), BF16, [lay(TP2, Shard(0, stride=2))], [lay(TP4, Shard(0, stride=2))]),
    ("proj", (6, 16), BF16, [lay(TP2, Shard(1))], [lay(TP4, Shard(1))]),
    ("proj_s2", (6, 16), BF16, [lay(TP2, Shard(1, stride=2))], [lay(TP4, Shard(1, stride=2))]),
    ("emb", (13, 5), F32, [lay((0, 1, 2), Shard(0))], [lay(TP4, Shard(0))]),
    ("ln", (7,), F32, [lay(TP2)], [lay(TP4)]),
    ("f8", (8, 4), F8, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
    ("scalar", (), F32, [lay((0,))], [lay(TP4)]),
    ("dp2", (8, 3), BF16, [lay(TP2, Shard(0)), lay((2, 3), Shard(0))], [lay(TP4, Shard(0))]),
    ("disjoint", (6, 10), F32, [lay(TP2, Shard(0))], [lay((2, 3), Shard(1))]),
]
COLUMN = [MIXED[0]]
ROW = [MIXED[2]]
TRANSFORMED = [
    ("tq", (16, 8), BF16, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
    ("tr", (8, 16), BF16, [lay(TP2, Shard(1))], [lay(TP4, Shard(1))]),
    ("plain", (16, 8), BF16, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
]
CAST = [("w", (8, 4), F32, [lay(TP2, Shard(0))], [lay(TP4, Shard(1))])]
LARGE = [  # every TP4 slice of the first two is 256 KiB (DIRECT_MIN_BYTES): a message of its own
    ("big_col", (2048, 256), BF16, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
    ("big_row", (256, 2048), BF16, [lay(TP2, Shard(1))], [lay(TP4, Shard(1))]),
    ("ln", (7,), F32, [lay(TP2)], [lay(TP4)]),
    ("qkv", (16, 6), BF16, [lay(TP2, Shard(0))], [lay(TP4, Shard(0))]),
]


def global_tensor(name: str, shape, dtype: torch.dtype, version: int) -> torch.Tensor:
    """Deterministic random bits (every pattern, NaNs included) for ``name`` at ``version``."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * version)
    if dtype is F32 and name == "w":  # the cast scenario wants ordinary numbers
        return torch.randn(shape, generator=gen)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def local_of(full: torch.Tensor, layouts, rank: int) -> torch.Tensor | None:
    """This rank's local tensor of ``full`` under the first of ``layouts`` that holds it."""
    for layout in layouts:
        shape = layout.local_shape(tuple(full.shape), rank)
        if shape is None:
            continue
        local = torch.empty(shape, dtype=full.dtype)
        for box in layout.boxes(tuple(full.shape), rank):
            region(local, box.local_offsets, box.sizes).copy_(region(full, box.offsets, box.sizes))
        return local
    return None


def table_of(tensors):
    builder = TableBuilder()
    for name, shape, dtype, src, dst in tensors:
        meta = TensorMeta(name, shape, dtype)
        for side, layouts in (("src", src), ("dst", dst)):
            for layout in layouts:
                builder.add(side, layout.mesh.ranks[0], meta, layout)
    return builder.build()


class CountingGloo(GlooCopyService):
    """Gloo, recording every submitted send as (batch, peer, bytes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[int, int, int]] = []

    def submit_send(self, tensor, dest_rank, task_id):
        self.sent.append((task_id >> 60, dest_rank, tensor.nbytes))
        super().submit_send(tensor, dest_rank, task_id)


class MarkTransform(ReshardTransform):
    """Sender-side conversion producing two wire tensors per op: the bf16 bits as int16 and a float32
    row amax ("scale"). It owns its destinations (no destination tensor is passed to the executor)."""

    def __init__(self, rank: int, tensors):
        self.names = {name for name, *_ in tensors if name.startswith("t")}
        self.owned = {}
        for name, shape, dtype, _, dst in tensors:
            if name in self.names and (shape_ := dst[0].local_shape(shape, rank)) is not None:
                self.owned[name] = torch.full(shape_, float("nan"), dtype=dtype)
        self.scales: dict[str, list] = {}
        self.finalized: list[str] = []

    def should_transform(self, name):
        return name in self.names

    def prepare_send(self, name, op, src_view):
        return [src_view.contiguous().view(torch.int16), src_view.float().abs().amax(-1)]

    def prepare_recv(self, name, op):
        return [torch.empty(op.sizes, dtype=torch.int16), torch.empty(op.sizes[:-1], dtype=F32)]

    def finalize_recv(self, name, op, buffers):
        data, scale = buffers
        region(self.owned[name], op.dst_local, op.sizes).copy_(data.view(BF16))
        self.scales.setdefault(name, []).append((op.offsets, op.sizes, scale.clone()))

    def finalize_tensor(self, name):
        self.finalized.append(name)

    def transient_bytes(self, name):
        return 1000


def _fill(rank, tensors, version, existing=None):
    """Source locals at ``version`` (written into ``existing`` in place when given)."""
    src = existing if existing is not None else {}
    for name, shape, dtype, layouts, _ in tensors:
        local = local_of(global_tensor(name, shape, dtype, version), layouts, rank)
        if local is None:
            continue
        if name in src:
            src[name].copy_(local)
        else:
            src[name] = local
    return src


def _mismatches(rank, tensors, dst, version, dtype_of=None) -> list[str]:
    bad = []
    for name, shape, dtype, _, layouts in tensors:
        if name not in dst:
            continue
        want = local_of(global_tensor(name, shape, dtype, version), layouts, rank)
        if dtype_of is not None:
            want = want.to(dtype_of)
        if not same_bytes(dst[name], want):
            bad.append(name)
    return bad


def sends_of(plan) -> list:
    return [op for op in plan.ops if op.kind is OpKind.SEND]


def _refit_twice(rank, tensors, *, budget=None, cast_to=None, transform=None):
    """Plan, then execute twice (new source values the second time); report what the test checks."""
    plan = plan_rank(table_of(tensors), rank, max_batch_bytes=budget)
    src = _fill(rank, tensors, 0)
    dst = {}
    for name, shape, dtype, _, layouts in tensors:
        local_shape = layouts[0].local_shape(shape, rank)
        if local_shape is not None and (transform is None or not transform.should_transform(name)):
            dst[name] = torch.full(local_shape, 7, dtype=torch.uint8).view(torch.uint8).to(cast_to or dtype)
    pointers = {name: t.data_ptr() for name, t in dst.items()}
    transport = CountingGloo(timeout=60)
    pool = StagingPool()  # the second refit reuses the first one's staging buffers
    out = {"mismatch": [], "plan_batches": plan.num_batches}
    for version in (0, 1):
        _fill(rank, tensors, version, src)
        cast = cast_to is not None
        stats = execute_plan(plan, src, dst, transport, transform=transform, cast=cast, pool=pool)
        out["mismatch"] += [f"v{version}:{n}" for n in _mismatches(rank, tensors, dst, version, cast_to)]
    transport.close()
    sends = {(op.batch, op.peer) for op in plan.ops if op.kind is OpKind.SEND and op.numel}
    out.update(
        stats=stats,
        moved_pointers=[n for n, t in dst.items() if t.data_ptr() != pointers[n]],
        sent=sorted((b, p) for b, p, _ in transport.sent[: len(transport.sent) // 2]),
        expected_sent=sorted(sends),
        local_ops=sum(op.kind is OpKind.LOCAL for op in plan.ops),
        large_sends=sum(op.kind is OpKind.SEND and op.name.startswith("big") for op in plan.ops),
        small_peers=len({op.peer for op in sends_of(plan) if not op.name.startswith("big")}),
        small_bytes=sum(plan.bytes_of(op) for op in plan.ops if op.peer != rank and "big" not in op.name),
        strided_send_bytes=sum(plan.bytes_of(op) for op in sends_of(plan) if op.name == "big_row"),
        pooled_bytes=pool.held_bytes,
    )
    return out


def _transform_scenario(rank):
    transform = MarkTransform(rank, TRANSFORMED)
    out = _refit_twice(rank, TRANSFORMED, transform=transform)
    problems = []
    for name, shape, dtype, _, layouts in TRANSFORMED:
        if name not in transform.owned:
            continue
        full = global_tensor(name, shape, dtype, 1)
        if not same_bytes(transform.owned[name], local_of(full, layouts, rank)):
            problems.append(f"{name}: data")
        for offsets, sizes, scale in transform.scales[name][len(transform.scales[name]) // 2 :]:
            want = region(full, offsets, sizes).float().abs().amax(-1)
            if not same_bytes(scale, want):
                problems.append(f"{name}: scale at {offsets}")
    out.update(problems=problems, finalized=sorted(transform.finalized), owned=sorted(transform.owned))
    return out


def _colocated_world(rank, world):
    return {
        "mixed": _refit_twice(rank, MIXED),
        "budget": _refit_twice(rank, MIXED, budget=128),
        "column": _refit_twice(rank, COLUMN),
        "row": _refit_twice(rank, ROW),
        "transform": _transform_scenario(rank),
        "cast": _refit_twice(rank, CAST, cast_to=BF16),
        "large": _refit_twice(rank, LARGE),
    }


@pytest.fixture(scope="module")
def colocated():
    return run_world(_colocated_world, 4, timeout=240)


@pytest.mark.parametrize("scenario", ["mixed", "budget", "column", "row", "transform", "cast", "large"])
def test_every_destination_byte_equals_the_source_in_place(colocated, scenario):
    for rank, results in enumerate(colocated):
        out = results[scenario]
        assert out["mismatch"] == [], f"rank {rank}"
        assert out["moved_pointers"] == [], f"rank {rank}"


@pytest.mark.parametrize("scenario", ["mixed", "budget", "transform", "cast"])
def test_one_message_per_peer_per_batch(colocated, scenario):
    for results in colocated:
        out = results[scenario]
        assert out["sent"] == out["expected_sent"]  # each (batch, peer) exactly once
        assert out["stats"].messages_sent == len(out["expected_sent"])
        assert out["stats"].messages == out["stats"].messages_sent


def test_large_slices_travel_alone_and_unstaged_where_contiguous(colocated):
    """A 256 KiB slice is a message of its own; column slices go from the source and into the
    destination as they are, row slices are packed by the sender only (their source is strided)."""
    sent = 0
    for rank, results in enumerate(colocated):
        out = results["large"]
        assert out["stats"].messages_sent == out["large_sends"] + out["small_peers"], f"rank {rank}"
        staged = out["stats"].peak_staging_bytes - out["strided_send_bytes"]  # + small packed messages
        assert 0 <= staged <= out["small_bytes"], f"rank {rank}"
        sent += out["large_sends"]
    assert sent == 6  # big_col and big_row: ranks 1, 2 and 3 each receive a quarter of both


def test_mixed_plan_moves_remote_and_local_bytes(colocated):
    stats = [r["mixed"]["stats"] for r in colocated]
    assert sum(s.bytes_sent for s in stats) == sum(s.bytes_received for s in stats) > 0
    assert all(s.batches == 1 for s in stats)
    assert sum(r["mixed"]["local_ops"] for r in colocated) > 0
    assert sum(s.bytes_local for s in stats) > 0


def test_small_budget_runs_several_batches(colocated):
    plan_batches = {r["budget"]["plan_batches"] for r in colocated}
    assert len(plan_batches) == 1 and plan_batches.pop() > 3
    assert max(r["budget"]["stats"].batches for r in colocated) > 3
    mixed = sum(r["mixed"]["stats"].messages_sent for r in colocated)
    assert sum(r["budget"]["stats"].messages_sent for r in colocated) > mixed


def test_single_contiguous_slices_are_never_staged(colocated):
    # column-parallel TP2->TP4: every message is one contiguous slice, sent and received in place
    assert [r["column"]["stats"].peak_staging_bytes for r in colocated] == [0, 0, 0, 0]
    assert [r["column"]["pooled_bytes"] for r in colocated] == [0, 0, 0, 0]
    # row-parallel destinations are strided: received into a staging buffer, unpacked with one copy
    assert max(r["row"]["stats"].peak_staging_bytes for r in colocated) > 0
    assert max(r["row"]["pooled_bytes"] for r in colocated) > 0


def test_transform_with_two_wire_tensors_including_local_ops(colocated):
    for rank, results in enumerate(colocated):
        out = results["transform"]
        assert out["problems"] == [], f"rank {rank}"
        assert out["owned"] == ["tq", "tr"]
        assert out["finalized"] == ["tq", "tq", "tr", "tr"]  # once per tensor per refit
        assert out["stats"].peak_staging_bytes >= 2000  # both tensors' declared accumulators
    assert colocated[0]["transform"]["local_ops"] > 0


def _stalled_world(rank, world, timeout):
    tensors = [("w", (8, 4), F32, [lay((0,))], [lay((1, 2), Shard(0))])]
    plan = plan_rank(table_of(tensors), rank)
    if rank == 0:
        time.sleep(timeout + 6)  # never takes part
        return "stalled"
    dst = {"w": torch.zeros(4, 4)}
    start = time.monotonic()
    try:
        execute_plan(plan, {}, dst, GlooCopyService(timeout=timeout))
    except TransportError as exc:
        return str(exc), time.monotonic() - start
    return "no error"


def test_a_stalled_rank_makes_every_peer_raise_within_the_timeout_naming_it():
    results = run_world(_stalled_world, 3, 2.0, timeout=120, pg_timeout=60)
    assert results[0] == "stalled"
    for rank in (1, 2):
        message, _ = results[rank]
        task = (0 << 40) | (0 << 20) | rank
        assert message == (
            f"transport 'gloo' (plugin reshard-gloo): rank {rank}, batch 0: gloo: recv from rank 0 "
            f"(task {task}, 64 bytes) failed: "
            "timed out after 2 s"
        )


GLOO = "transport 'gloo' (plugin reshard-gloo): "


class WaitCounting(GlooCopyService):
    """Gloo, counting the waits that block with the full timeout (giving up waits 1 ms, uncounted)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocking_waits = 0

    def _wait_issued(self, issued, deadline):
        self.blocking_waits += 1
        super()._wait_issued(issued, deadline)


def _stalled_many_batches_world(rank, world, timeout):
    names = [f"w{k}" for k in range(5)]
    tensors = [(n, (8, 4), F32, [lay((0,))], [lay((1, 2), Shard(0))]) for n in names]
    plan = plan_rank(table_of(tensors), rank, max_batch_bytes=1)  # one batch per tensor
    if rank == 0:
        time.sleep(timeout + 6)
        return "stalled"
    dst = {n: torch.zeros(4, 4) for n in names}
    transport = WaitCounting(timeout=timeout)
    try:
        execute_plan(plan, {}, dst, transport)
    except TransportError as exc:
        return str(exc), plan.num_batches, transport.blocking_waits
    return "no error"


def test_a_stalled_rank_with_many_batches_in_flight_costs_one_timeout_not_one_per_batch():
    results = run_world(_stalled_many_batches_world, 3, 2.0, timeout=120, pg_timeout=60)
    assert results[0] == "stalled"
    for rank in (1, 2):
        message, batches, blocking_waits = results[rank]
        task = (0 << 40) | (0 << 20) | rank
        assert batches == 5
        assert message == (  # a subclass defined here is named by its module, not a plugin
            f"transport 'gloo' (not a plugin: {WaitCounting.__module__}.WaitCounting): "
            f"rank {rank}, batch 0: gloo: recv from rank 0 "
            f"(task {task}, 64 bytes) failed: "
            "timed out after 2 s"
        )
        assert blocking_waits == 1  # the other batches' receives were given up, not waited out


def _killed_world(rank, world):
    tensors = [("w", (8, 4), F32, [lay((0,))], [lay((0, 1, 2), Shard(0))])]
    plan = plan_rank(table_of(tensors), rank)
    dist.barrier()
    if rank == 0:
        os._exit(3)  # dies without a word while its peers wait for its data
    dst = {"w": torch.zeros(3, 4) if rank == 1 else torch.zeros(2, 4)}
    execute_plan(plan, {}, dst, GlooCopyService(timeout=30))


def test_a_killed_rank_makes_every_peer_raise_naming_it():
    with pytest.raises(WorldError) as info:
        run_world(_killed_world, 3, timeout=120)
    text = str(info.value)
    assert "ranks 0 (exit code 3) died without reporting" in text
    for rank in (1, 2):
        section = text.split(f"rank {rank} failed:\n", 1)[1].splitlines()[0]
        assert section.startswith(f"TransportError: {GLOO}rank {rank}, batch 0: gloo: ")
        assert "from rank 0 (task" in section
        assert section.endswith("connection closed by the peer (it exited, failed or gave up)")
