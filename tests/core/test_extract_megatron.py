"""Megatron-Core GPTModel (dense and MoE) under several TP/PP/EP layouts in one 4-rank Gloo world.

Every layout is built from the same seed; the TP1/PP1/EP1 model built on each rank is the reference.
Checks: the same canonical names, shapes and dtypes in every layout; each rank's local tensor equals,
bit for bit, the region of the reference tensor its boxes name; every rank of a mesh reports the
identical layout; each layout tiles its tensor; and the exact layouts of a few weights.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")

WORLD = 4
DENSE = {"tp2": (2, 1, 1), "tp4": (4, 1, 1), "tp2pp2": (2, 2, 1), "pp2": (1, 2, 1)}
MOE = {"ep2": (1, 1, 2), "tp2ep2": (2, 1, 2), "ep4": (1, 1, 4), "pp2ep2": (1, 2, 2)}
FAMILIES = {
    "dense": (DENSE, dict(num_layers=4)),
    "moe": (MOE, dict(num_layers=4, num_moe_experts=4, expert_bias=True, bias=False)),  # MoE bias needs ETP1
}


def _region(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def _check(specs, full, rank):
    """(name, shape, dtype, layout) rows and the names whose boxes disagree with the reference."""
    rows, bad = [], []
    for s in specs:
        rows.append((s.meta.name, s.meta.shape, str(s.meta.dtype), s.layout))
        ref = full.get(s.meta.name)
        boxes = s.layout.boxes(s.meta.shape, rank)
        if ref is None or not boxes or not all(
            torch.equal(_region(s.tensor, b.local_offsets, b.sizes), _region(ref, b.offsets, b.sizes))
            for b in boxes
        ):
            bad.append(s.meta.name)
    return rows, bad


def _megatron_world(rank: int, world: int):
    from torch import nn

    from reshard_core.extract import extract_specs
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    init_megatron()
    out = {}
    for family, (layouts, kwargs) in FAMILIES.items():
        ref = build_gpt(build_pg_collection(1, 1, 1), seed=7, **kwargs)
        full = {s.meta.name: s.tensor for s in extract_specs(ref, "src")}
        out[(family, "ref")] = _check(extract_specs(ref, "src"), full, rank)
        for key, (tp, pp, ep) in layouts.items():
            model = build_gpt(build_pg_collection(tp, pp, ep), seed=7, **kwargs)
            out[(family, key)] = _check(extract_specs(model, "dst"), full, rank)
    # tied embeddings on one stage: no output_layer.weight (tied PP>1 needs CUDA to build)
    tied = {}
    for key, (tp, pp) in (("tp1", (1, 1)), ("tp2", (2, 1))):
        model = build_gpt(build_pg_collection(tp, pp, 1), seed=7, num_layers=4, tied=True)
        names = (s.meta.name for s in extract_specs(model, "src"))
        tied[key] = sorted(n for n in names if not n.startswith("decoder."))
    out["tied"] = tied
    # TP attributes but no pg_collection: groups come from the initialised parallel_state (TP1, DP4)
    lin = nn.Linear(4, 2, bias=False)
    lin.weight.tensor_model_parallel, lin.weight.partition_dim = True, 0
    out["parallel_state"] = [(s.meta.name, s.layout) for s in extract_specs(lin, "src")]
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_megatron_world, WORLD, timeout=300)


def _by_layout(results, key):
    """name -> {rank: (shape, dtype, layout)} for one layout, plus the per-rank mismatch lists."""
    table = defaultdict(dict)
    for rank, out in enumerate(results):
        for name, shape, dtype, layout in out[key][0]:
            table[name][rank] = (shape, dtype, layout)
    return table, [out[key][1] for out in results]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_matches_the_reference(results, family):
    ref, _ = _by_layout(results, (family, "ref"))
    ref_meta = {name: next(iter(per_rank.values()))[:2] for name, per_rank in ref.items()}
    for key in ("ref", *FAMILIES[family][0]):
        table, mismatches = _by_layout(results, (family, key))
        assert set(table) == set(ref_meta), key
        assert mismatches == [[]] * WORLD, key
        for name, per_rank in table.items():
            layouts = {entry[2] for entry in per_rank.values()}
            for rank, (shape, dtype, layout) in per_rank.items():
                assert (shape, dtype) == ref_meta[name], (key, name)
                for peer in layout.mesh.ranks:  # every rank of a mesh reports that very layout
                    assert per_rank.get(peer, (None, None, None))[2] == layout, (key, name, rank, peer)
            cover = torch.zeros(ref_meta[name][0], dtype=torch.int64)
            for layout in layouts:
                copies = math.prod(s for s, p in zip(layout.mesh.shape, layout.placements, strict=True)
                                   if isinstance(p, Replicate))  # fmt: skip
                one = torch.zeros_like(cover)
                for peer in layout.mesh.ranks:
                    for b in layout.boxes(ref_meta[name][0], peer):
                        _region(one, b.offsets, b.sizes).add_(1)
                assert bool((one == copies).all()), (key, name, layout)
                cover += one
            assert bool((cover > 0).all()), (key, name)


def _names(results, key, rank):
    return {name for name, *_ in results[rank][key][0]}


def _layout(results, key, rank, name):
    return next(row[3] for row in results[rank][key][0] if row[0] == name)


@pytest.mark.slow
def test_pipeline_stages_hold_global_layer_names(results):
    modules = ("input_layernorm", "self_attention.linear_qkv", "self_attention.linear_proj",
               "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")  # fmt: skip
    stage1 = {f"decoder.layers.{i}.{m}.{p}" for i in (2, 3) for m in modules for p in ("weight", "bias")}
    stage1 |= {"decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"}
    assert _names(results, ("dense", "tp2pp2"), 2) == stage1  # TP2 PP2: ranks 2, 3 are stage 1
    assert _names(results, ("dense", "pp2"), 1) == stage1  # PP2 DP2: pp groups (0, 1), (2, 3)


ALL4 = Mesh((0, 1, 2, 3), (4,))
GRID = Mesh((0, 1, 2, 3), (2, 2))  # (DP, TP) replica grid
STAGE1, ODD, SOLO3 = Mesh((2, 3), (2,)), Mesh((1, 3), (2,)), Mesh((3,), (1,))
L0, L2, L3 = "decoder.layers.0", "decoder.layers.2", "decoder.layers.3"
E3 = "mlp.experts.local_experts.3"
EXACT = [
    (("dense", "ref"), 0, f"{L0}.mlp.linear_fc1.weight", Layout(ALL4, (Replicate(),))),
    (("dense", "tp2"), 3, f"{L0}.mlp.linear_fc1.weight", Layout(GRID, (Replicate(), Shard(0, stride=2)))),
    (("dense", "tp2"), 3, "decoder.final_layernorm.weight", Layout(GRID, (Replicate(), Replicate()))),
    (("dense", "tp4"), 1, f"{L3}.self_attention.linear_proj.weight", Layout(ALL4, (Shard(1),))),
    (("dense", "tp4"), 1, "embedding.word_embeddings.weight", Layout(ALL4, (Shard(0),))),
    (("dense", "tp2pp2"), 3, f"{L2}.self_attention.linear_qkv.weight", Layout(STAGE1, (Shard(0),))),
    (("dense", "tp2pp2"), 3, "output_layer.weight", Layout(STAGE1, (Shard(0),))),
    (("dense", "pp2"), 3, f"{L3}.mlp.linear_fc2.weight", Layout(ODD, (Replicate(),))),
    (("moe", "ep2"), 1, f"{L0}.{E3}.linear_fc1.weight", Layout(ODD, (Replicate(),))),
    (("moe", "ep2"), 1, f"{L0}.mlp.router.expert_bias", Layout(ODD, (Replicate(),))),
    (("moe", "tp2ep2"), 2, "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
     Layout(STAGE1, (Shard(0, stride=2),))),
    (("moe", "ep4"), 3, f"{L0}.{E3}.linear_fc2.weight", Layout(SOLO3, (Replicate(),))),
    (("moe", "pp2ep2"), 3, f"{L3}.{E3}.linear_fc2.weight", Layout(SOLO3, (Replicate(),))),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("key", "rank", "name", "layout"), EXACT)
def test_exact_layouts(results, key, rank, name, layout):
    assert _layout(results, key, rank, name) == layout


@pytest.mark.slow
def test_expert_indices_are_global(results):
    def experts(key, rank):
        return sorted({int(n.split(".")[6]) for n in _names(results, key, rank) if ".local_experts." in n})

    assert [experts(("moe", "ep2"), r) for r in range(WORLD)] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [experts(("moe", "tp2ep2"), r) for r in range(WORLD)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [experts(("moe", "ep4"), r) for r in range(WORLD)] == [[0], [1], [2], [3]]
    assert [experts(("moe", "pp2ep2"), r) for r in range(WORLD)] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert "decoder.layers.3.mlp.router.expert_bias" in _names(results, ("moe", "pp2ep2"), 3)


@pytest.mark.slow
def test_parallel_state_groups_when_no_pg_collection(results):
    for out in results:
        assert out["parallel_state"] == [("weight", Layout(Mesh((0, 1, 2, 3), (4,)), (Replicate(),)))]


@pytest.mark.slow
def test_tied_embeddings_are_the_documented_exception(results):
    embeddings = ["embedding.position_embeddings.weight", "embedding.word_embeddings.weight"]
    assert [out["tied"] for out in results] == [{"tp1": embeddings, "tp2": embeddings}] * WORLD
