"""Offline simulation: layout strings, rank grids, catalogue shapes, and end-to-end validity."""

from __future__ import annotations

import math

import pytest
import torch

from reshard_core.catalogue import dump_json, get_model, load_json, model_names
from reshard_core.exchange.contribute import payloads_from_table
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.rank import plan_rank
from reshard_core.simulate.layouts import build_table
from reshard_core.simulate.parallel import Parallel, parse_parallel
from reshard_core.simulate.replay import replay
from reshard_core.simulate.run import simulate


def test_parse_layout_strings():
    assert parse_parallel("tp=8,pp=4,ep=8,etp=1,dp=2") == Parallel(tp=8, pp=4, ep=8, etp=1, dp=2)
    assert parse_parallel(" fsdp=64 ") == Parallel(fsdp=64)
    assert parse_parallel("tp=8,pp=4,ep=8,etp=1,dp=2").world == 512
    assert str(parse_parallel("dp=2,etp=1,tp=4")) == "tp=4,etp=1,dp=2"
    assert str(parse_parallel("tp=1,etp=1")) == "tp=1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=8,pp=x", "bad layout 'tp=8,pp=x': pp='x' is not a whole number"),
        ("tq=2", "bad layout 'tq=2': 'tq=2' is not one of tp/cp/ep/etp/pp/dp/fsdp=N"),
        ("tp=2,tp=4", "bad layout 'tp=2,tp=4': tp given twice"),
        ("tp=0", "bad layout 'tp=0': tp must be >= 1"),
        ("", "bad layout '': expected e.g. tp=8,pp=2 or fsdp=64"),
        ("tp=2,etp=4", "bad layout 'tp=2,etp=4': etp=4 must divide tp·cp·dp"),
    ],
)
def test_bad_layout_strings(text, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        parse_parallel(text)


def test_megatron_rank_order_tp_fastest_then_cp_ep_pp_dp():
    par = Parallel(tp=2, ep=2, pp=2, dp=2)
    # stage-local index j = tp + TP·(cp + CP·(ep + EP·(fsdp + FSDP·dp)))
    assert [par.rank(j, 0) for j in range(8)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert [par.rank(j, 1) for j in range(8)] == [4, 5, 6, 7, 12, 13, 14, 15]
    # 10 layers on 4 stages: [0, 2), [2, 5), [5, 7), [7, 10); -1 = before the layers, 10 = after
    stages = [Parallel(pp=4).stage_of_layer(layer, 10) for layer in (-1, 0, 1, 2, 3, 5, 9, 10)]
    assert stages == [0, 0, 0, 1, 1, 2, 3, 3]


def test_tables_follow_pipeline_stages_and_expert_ranks():
    table = build_table(get_model("tiny-gpt"), parse_parallel("tp=2,ep=2,pp=2"), parse_parallel("tp=4"), 8)
    emb = table["embedding.word_embeddings.weight"]
    assert emb.src == (Layout(Mesh((0, 2, 1, 3), (2, 2)), (Shard(0), Replicate())),)  # (tp, ep) mesh
    assert emb.dst == (Layout(Mesh((8, 9, 10, 11), (4,)), (Shard(0),)),)
    out = table["output_layer.weight"]
    assert out.src[0].mesh.ranks == (4, 6, 5, 7)
    expert = table["decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert expert.src == (Layout(Mesh((6, 7), (2,)), (Shard(0, stride=2),)),)  # stage 1, ep rank 1
    fc2 = table["decoder.layers.0.mlp.linear_fc2.weight"]
    assert fc2.dst[0].placements == (Shard(1),)


def test_fsdp_shards_the_tensor_parallel_part():
    table = build_table(get_model("tiny-gpt"), parse_parallel("tp=2,fsdp=2"), parse_parallel("tp=1"), 0)
    fc1 = table["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.src == (Layout(Mesh((0, 2, 1, 3), (2, 2)), (Shard(0, stride=2), Shard(0))),)


def test_catalogue_sizes_match_the_public_models():
    from reshard_core.catalogue import CONFIGS
    from reshard_core.simulate.formats import logical_shapes

    params = {n: sum(math.prod(t.shape) for t in get_model(n).tensors) for n in model_names()}
    assert params["llama3-8b"] == 8_030_261_248
    assert params["llama3-70b"] == 70_553_706_496
    assert round(params["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert round(params["deepseek-v3"] / 1e9) == 671
    assert round(params["kimi-k2"] / 1e9) == 1026  # "1T total"
    assert round(params["glm-4.5"] / 1e9) == 353  # 355B with its multi-token-prediction layer, left out here
    assert round(params["gpt-oss-120b"] / 1e9, 2) == 116.83
    assert len(get_model("deepseek-v3").tensors) == 30486
    assert get_model("deepseek-v3").num_experts == 256
    assert round(params["qwen3-next-80b"] / 1e9, 1) == 79.7
    qwen3_next = logical_shapes(CONFIGS["qwen3-next-80b"])  # HF's tensors: as many elements
    assert sum(math.prod(t.shape) for t in qwen3_next.tensors) == params["qwen3-next-80b"]


def test_json_shapes_round_trip_and_infer_layers_and_experts(tmp_path):
    model = get_model("tiny-gpt")
    path = tmp_path / "tiny.json"
    path.write_text(dump_json(model))
    assert load_json(path) == model
    bare = tmp_path / "bare.json"
    bare.write_text(
        '{"tensors": [{"name": "embedding.word_embeddings.weight", "shape": [8, 4], "kind": "vocab"},'
        '{"name": "decoder.layers.1.mlp.experts.linear_fc1.weight3", "shape": [4, 4], "kind": "strided"},'
        '{"name": "output_layer.weight", "shape": [8, 4], "dtype": "float32"}]}'
    )
    loaded = load_json(bare)
    assert [(t.layer, t.expert, t.dtype) for t in loaded.tensors] == [
        (-1, None, torch.bfloat16),
        (1, 3, torch.bfloat16),
        (2, None, torch.float32),
    ]


def test_json_errors_name_the_tensor(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"tensors": [{"name": "w", "shape": [4], "kind": "diagonal"}]}')
    with pytest.raises(ValueError) as info:
        load_json(bad)
    kinds = "replicated, column, row, strided, vocab"
    assert str(info.value) == f"{bad}: tensors[0] (w): key 'kind': \"diagonal\" is not one of {kinds}"
    bad.write_text('{"tensors": [{"name": "w", "shape": [4], "dtype": "float99"}]}')
    with pytest.raises(ValueError) as info:
        load_json(bad)
    assert str(info.value) == (
        f"{bad}: tensors[0] (w): key 'dtype': \"float99\" is not a torch dtype name such as bfloat16"
    )


LAYOUT_PAIRS = [
    ("tp=2,pp=2", "tp=4", 0),
    ("tp=2,ep=2,pp=2,dp=2", "tp=4,ep=4,etp=1", 0),
    ("fsdp=4", "tp=2,dp=2", 4),
    ("tp=2,fsdp=2,pp=2", "ep=2,dp=2", 0),
    ("tp=4,ep=4,etp=2", "tp=1", 16),
    ("tp=1", "tp=2,pp=4,dp=2", 0),
]


@pytest.mark.parametrize(("src", "dst", "offset"), LAYOUT_PAIRS)
def test_simulated_refits_move_every_element_exactly_once(src, dst, offset):
    model = get_model("tiny-gpt")
    s, d = parse_parallel(src), parse_parallel(dst)
    table = build_table(model, s, d, offset)
    report = simulate(model, s, d, dst_offset=offset, max_batch_bytes=64 * 1024)
    assert report.valid, report.problems
    assert len(report.planned) == report.ranks
    # replay the same plans on real tensors: every element from its own global coordinate
    plans = {r: plan_rank(table, r, max_batch_bytes=64 * 1024) for r in range(max(s.world, offset + d.world))}
    src_t, dst_t, want = {}, {}, {}
    for e in table.entries:
        full = torch.arange(math.prod(e.meta.shape), dtype=torch.float64).reshape(e.meta.shape)
        for side, store in (("src", src_t), ("dst", want)):
            for layout in e.layouts(side):
                for r in layout.mesh.ranks:
                    t = full
                    for dim, ivs in enumerate(layout.dim_intervals(tuple(full.shape), r)):
                        t = t.index_select(dim, torch.cat([torch.arange(a, b) for a, b in ivs]))
                    store[(r, e.name)] = t
    dst_t = {k: torch.full_like(v, -1) for k, v in want.items()}
    counts = replay(plans, src_t, dst_t)
    assert all(torch.equal(dst_t[k], want[k]) for k in want)
    assert all(bool((c == 1).all()) for c in counts.values())


def test_metadata_bytes_are_the_payloads_every_rank_receives():
    model = get_model("tiny-gpt")
    s, d = parse_parallel("tp=2,pp=2"), parse_parallel("tp=4")
    report = simulate(model, s, d, dst_offset=4)
    payloads = payloads_from_table(build_table(model, s, d, 4), range(8))
    assert report.metadata_bytes == sum(map(len, payloads.values())) + 8 * 8
    assert report.metadata_bytes_padded == (max(map(len, payloads.values())) + 8) * 8


def test_sampling_plans_a_spread_plus_the_busiest_candidates():
    model = get_model("llama3-8b")
    report = simulate(model, parse_parallel("tp=8,pp=4"), parse_parallel("tp=8,dp=4"), sample=4)
    planned = {s.rank for s in report.planned}
    assert {0, 8, 16, 24} <= planned and 4 <= len(planned) < 32
    assert report.valid
