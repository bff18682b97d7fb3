"""The demo/benchmark building blocks in one process: the pure-torch GPT and its values, layout
strings, the wire floor's per-pair volumes, and the benchmark's orchestration around a Megatron-Core
case that misses its deadline."""

from __future__ import annotations

import math
import time

import pytest
import torch
from reshard_bench.floor import LayoutCopies, local_volume, pair_volumes
from reshard_bench.gpt import GPT, PRESETS, GPTConfig, box_values, expected_local, tp_layout
from reshard_bench.layouts import resolve_layout
from reshard_bench.refit_bench import BenchOptions, BenchRun, parse_pair, report, run_bench

from reshard_core import SplitView
from reshard_core.layout import Layout, Mesh, Shard
from reshard_core.plan.ops import OpKind, RankPlan, TransferOp
from reshard_core.specs import TensorMeta
from reshard_core.testing.world import WorldStopped

TINY = PRESETS["tiny"]


def test_box_values_are_the_matching_region_of_the_full_tensor():
    shape = (6, 10)
    full = box_values("w", shape, (0, 0), shape, seed=3, dtype=torch.float32)
    assert torch.equal(box_values("w", shape, (2, 4), (3, 5), seed=3, dtype=torch.float32), full[2:5, 4:9])
    assert not torch.equal(full, box_values("w", shape, (0, 0), shape, seed=4, dtype=torch.float32))
    assert not torch.equal(full, box_values("v", shape, (0, 0), shape, seed=3, dtype=torch.float32))
    assert len(set(full.flatten().tolist())) == full.numel()  # a misplaced element shows


def test_a_gated_fc1_shard_is_gate_then_up_of_the_rank():
    name, shape = "decoder.layers.0.mlp.linear_fc1.weight", (16, 4)
    full = box_values(name, shape, (0, 0), shape, seed=1, dtype=torch.float32)
    local = expected_local(name, shape, tp_layout(name, (5, 6)), 6, seed=1, dtype=torch.float32)
    assert torch.equal(local, torch.cat([full[4:8], full[12:16]]))  # [gate_1; up_1] of TP2


def test_gpt_names_shapes_and_size_match_megatron():
    model = GPT(TINY)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == TINY.tensors()
    assert PRESETS["bench"].nbytes(torch.bfloat16) == pytest.approx(0.38e9, rel=0.02)
    tokens = torch.randint(0, TINY.vocab_size, (2, 5))
    assert model(tokens).shape == (2, 5, TINY.vocab_size)


def test_a_pipeline_stage_shard_uses_global_layer_names():
    stage = GPT(TINY, tp=2, layers=range(2, 4))
    names = stage.canonical_names()
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == "decoder.layers.2.mlp.linear_fc1.weight"
    assert stage.embedding is None and stage.output_layer is not None
    assert tuple(stage.decoder.layers[1].mlp.linear_fc2.weight.shape) == (64, 88)
    with pytest.raises(ValueError, match="ffn_hidden_size 176 does not divide by tp=3"):
        GPT(GPTConfig(1026, 66, 1, 6, 3, 176), tp=3)


@pytest.mark.parametrize(("text", "world", "expected"), [
    ("fsdp=4", 4, "fsdp=4"), ("tp=2", 4, "tp=2,dp=2"), ("tp=1", 4, "dp=4"),
    ("tp=2,pp=2", 8, "tp=2,pp=2,dp=2"),
])  # fmt: skip
def test_dp_fills_the_world(text, world, expected):
    assert str(resolve_layout(text, world)) == expected


def test_pair_parsing():
    assert parse_pair("tp=2,pp=2->tp=1") == ("tp=2,pp=2", "tp=1")
    assert parse_pair("tp=4:tp=2") == ("tp=4", "tp=2")
    with pytest.raises(ValueError, match="bad layout pair 'tp=2->'"):
        parse_pair("tp=2->")


def test_floor_volumes_are_the_plan_s_remote_bytes_per_peer():
    meta = {"a": TensorMeta("a", (8, 4), torch.bfloat16), "b": TensorMeta("b", (2,), torch.float32)}
    op = lambda kind, name, peer, sizes: TransferOp(kind, name, peer, (0,) * len(sizes), sizes, None, None)  # noqa: E731
    plan = RankPlan(0, (op(OpKind.SEND, "a", 1, (2, 4)), op(OpKind.SEND, "b", 1, (2,)),
                        op(OpKind.RECV, "a", 2, (4, 4)), op(OpKind.LOCAL, "a", 0, (2, 4)),
                        op(OpKind.SEND, "a", 3, (1, 4))), meta)  # fmt: skip
    assert pair_volumes(plan) == ({1: 2 * 4 * 2 + 2 * 4, 3: 4 * 2}, {2: 4 * 4 * 2})
    assert local_volume(plan) == 2 * 4 * 2


def test_the_layout_floor_copies_what_the_layouts_force_once_and_never_touches_the_models():
    meta = {"w": TensorMeta("w", (4, 8), torch.bfloat16)}
    op = lambda kind, peer, src_at, dst_at, sizes: TransferOp(kind, "w", peer, (0, 0), sizes, src_at, dst_at)  # noqa: E731
    plan = RankPlan(0, (
        op(OpKind.LOCAL, 0, (0, 0), (0, 0), (4, 2)),  # a column slice of the source into the shard
        op(OpKind.SEND, 1, (0, 2), (0, 0), (4, 2)),  # strided here: packed once
        op(OpKind.SEND, 2, (2, 0), (0, 0), (2, 8)),  # whole rows: sent as it lies, no copy
        op(OpKind.RECV, 3, (0, 0), (0, 2), (4, 2)),  # strided here: unpacked once
        op(OpKind.RECV, 1, (0, 0), (2, 0), (2, 8)),  # whole rows: received in place, no copy
    ), meta)  # fmt: skip
    src = torch.nn.Parameter(torch.arange(32, dtype=torch.bfloat16).view(4, 8))  # as a model holds them
    dst = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16))
    copies = LayoutCopies(plan, {"w": src}, {"w": dst})
    assert len(copies.copies) == 3 and copies.nbytes == 3 * 4 * 2 * 2
    copies.run()
    copies.run()  # again, as the bench repeats it
    (local_dst, local_src), (pack, packed), (unpacked, incoming) = copies.copies
    assert torch.equal(local_dst, src[:, 0:2]) and local_dst.stride() == (8, 1)  # a view of a clone of dst
    assert torch.equal(pack, src[:, 2:4]) and pack.is_contiguous()
    assert torch.equal(unpacked, torch.ones(4, 2, dtype=torch.bfloat16)) and not unpacked.is_contiguous()
    assert torch.equal(dst, torch.zeros(4, 8, dtype=torch.bfloat16))  # the model's tensor untouched
    assert torch.equal(src, torch.arange(32, dtype=torch.bfloat16).view(4, 8))


def test_the_layout_floor_reads_split_views_and_refuses_a_region_across_their_blocks():
    meta = {"w": TensorMeta("w", (8, 8), torch.float32)}
    split = SplitView(torch.arange(64.0).view(2, 4, 8), ((2, 4), (8,)))  # logical rows 4b..4b+3 = base[b]
    op = lambda at: TransferOp(OpKind.SEND, "w", 1, at, (4, 8), at, (0, 0))  # noqa: E731
    whole_block = RankPlan(0, (op((4, 0)),), meta)
    assert LayoutCopies(whole_block, {"w": split}, {}).copies == []  # one block: sent as it lies
    with pytest.raises(ValueError) as raised:
        LayoutCopies(RankPlan(0, (op((2, 0)),), meta), {"w": split}, {})
    expected = "the layout floor copies plain regions; w's region at (2, 0) spans blocks of a split view"
    assert str(raised.value) == expected


def _row(seconds: float) -> dict:
    return {"refit_seconds": seconds, "floor_seconds": seconds / 2, "floor_with_local_seconds": seconds * 0.8,
            "floor_bytes": 1, "verified": True}  # fmt: skip


def test_a_megatron_case_past_its_deadline_is_reported_and_the_rest_run_in_a_fresh_world():
    opts = BenchOptions(model="gpt", size="tiny", pairs=("A", "B", "C"), megatron_deadline=7.0)
    calls = []

    def fake_spawn(fn, world, opts_, pending, *, on_event, watchdog, timeout, pg_timeout):
        calls.append(list(pending))
        for pair in pending:
            on_event(0, "ours", (pair, _row(0.1)))
            on_event(0, "megatron-start", pair)
            if pair == "B":
                raise WorldStopped("B")  # what spawn_world raises when the watchdog names B
            on_event(0, "megatron", (pair, {"finished": True, "seconds": 0.4, "verified": True}))

    out = run_bench(opts, spawn=fake_spawn)
    assert calls == [["A", "B", "C"], ["C"]]
    rows = {r["pair"]: r for r in out["rows"]}
    assert rows["B"]["megatron"] == {"finished": False, "deadline": 7.0} and "speedup" not in rows["B"]
    assert rows["A"]["speedup"] == pytest.approx(4.0) and rows["C"]["speedup"] == pytest.approx(4.0)
    assert rows["A"]["floor_ratio"] == pytest.approx(2.0)
    assert rows["A"]["speedup_bound"] == pytest.approx(5.0) and "speedup_bound" not in rows["B"]


def test_the_watchdog_names_the_pair_only_once_its_deadline_passed():
    run = BenchRun(BenchOptions(megatron_deadline=30.0))
    assert run.watchdog() is None
    run.megatron_started = ("tp=2->tp=4", time.monotonic())
    assert run.watchdog() is None
    run.megatron_started = ("tp=2->tp=4", time.monotonic() - 31.0)
    assert run.watchdog() == "tp=2->tp=4"


def test_report_without_results_keeps_every_pair():
    out = report(BenchOptions(model="gpt", size="tiny", pairs=("tp=2->tp=4",)), {})
    assert out["rows"] == [{"pair": "tp=2->tp=4", "ours": None, "megatron": None}]
    assert out["model_bytes"] == sum(math.prod(s) for s in TINY.tensors().values()) * 2
    assert Layout(Mesh.of((0, 1)), (Shard(0),)) == tp_layout("output_layer.weight", (0, 1))
