"""Megatron-style extraction on duck-typed module trees, simulating one rank of a larger world in process.

Group rosters are seeded into the context's cache (what ``torch.distributed.get_process_group_ranks``
would return on that rank), so names, meshes and errors can be checked without processes.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from reshard_core.extract import ExtractContext, ExtractError, extract_specs
from reshard_core.layout import Layout, Mesh, Replicate, Shard


def tp_param(*shape, dim=0, stride=1, sizes=None, expert=False):
    p = nn.Parameter(torch.zeros(*shape))
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    if sizes is not None:
        p.partition_sizes = sizes
    if expert:
        p.allreduce = False
    return p


class GroupedLinear(nn.Module):
    """Like TE's GroupedLinear: one weightK per local expert and ``num_gemms``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.num_gemms = n
        for k in range(n):
            self.register_parameter(f"weight{k}", tp_param(4, 3, stride=2, expert=True))


class Layer(nn.Module):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.proj = nn.Module()
        self.proj.weight = tp_param(3, 2, dim=1)
        self.norm = nn.LayerNorm(3)
        self.experts = nn.Module()
        self.experts.linear_fc1 = GroupedLinear(2)
        self.seq = nn.Module()
        self.seq.local_experts = nn.ModuleList([nn.Module(), nn.Module()])
        for e in self.seq.local_experts:
            e.weight = tp_param(2, 3, expert=True)
            e.bias = nn.Parameter(torch.zeros(3))
            e.bias.allreduce = False
        self.register_buffer("expert_bias", torch.zeros(4))


class Model(nn.Module):
    def __init__(self, pgs) -> None:
        super().__init__()
        self.pg_collection = pgs
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([Layer(3), Layer(4)])  # stage 2 of a 4-layer, PP2 model
        self.qkv = nn.Module()
        self.qkv.weight = tp_param(8, 2, sizes=[4, 2, 2])


GROUPS = ("tp", "dp", "ep", "expt_tp", "expt_dp")


def make(rank: int, world: int, rosters: dict[str, tuple[int, ...]], **ctx_kwargs):
    """A model whose pg_collection holds one dummy group per roster, and the context of ``rank``."""
    groups = {name: object() for name in rosters}
    ctx = ExtractContext(rank=rank, world=world, **ctx_kwargs)
    for name, ranks in rosters.items():
        ctx.caches[("ranks", id(groups[name]))] = ranks
    return Model(SimpleNamespace(**groups)), ctx


# rank 5 of 8: TP (4, 5), DP (1, 5); experts: EP (3, 5) -> ep rank 1, expt_tp (5,), expt_dp (5, 7)
ROSTERS = {"tp": (4, 5), "dp": (1, 5), "ep": (3, 5), "expt_tp": (5,), "expt_dp": (5, 7)}


def test_names_layouts_and_shapes_on_one_rank():
    model, ctx = make(5, 8, ROSTERS)
    specs = extract_specs(model, "src", context=ctx)
    dense = Mesh((0, 1, 4, 5), (2, 2))
    experts = Mesh((5, 7), (2,))
    got = {s.meta.name: (s.meta.shape, s.layout) for s in specs}
    expected = {}
    for layer in (2, 3):
        p = f"decoder.layers.{layer}"
        expected.update({
            f"{p}.proj.weight": ((3, 4), Layout(dense, (Replicate(), Shard(1)))),
            f"{p}.norm.weight": ((3,), Layout(dense, (Replicate(), Replicate()))),
            f"{p}.norm.bias": ((3,), Layout(dense, (Replicate(), Replicate()))),
            f"{p}.experts.linear_fc1.weight2": ((4, 3), Layout(experts, (Replicate(),))),
            f"{p}.experts.linear_fc1.weight3": ((4, 3), Layout(experts, (Replicate(),))),
            f"{p}.seq.local_experts.2.weight": ((2, 3), Layout(experts, (Replicate(),))),
            f"{p}.seq.local_experts.2.bias": ((3,), Layout(experts, (Replicate(),))),
            f"{p}.seq.local_experts.3.weight": ((2, 3), Layout(experts, (Replicate(),))),
            f"{p}.seq.local_experts.3.bias": ((3,), Layout(experts, (Replicate(),))),
            f"{p}.expert_bias": ((4,), Layout(dense, (Replicate(), Replicate()))),
        })  # fmt: skip
    expected["qkv.weight"] = ((16, 2), Layout(dense, (Replicate(), Shard(0, components=(8, 4, 4)))))
    assert got == expected
    assert [s.meta.name for s in specs][:3] == [
        "decoder.layers.2.proj.weight",
        "decoder.layers.2.norm.weight",
        "decoder.layers.2.norm.bias",
    ]


def test_expert_tp_split_and_one_layout_per_tp_group_without_the_replica_grid():
    rosters = dict(ROSTERS, expt_tp=(4, 5), expt_dp=(1, 5))
    model, ctx = make(5, 8, rosters, replica_grid=False)
    got = {s.meta.name: s.layout for s in extract_specs(model, "dst", context=ctx)}
    pair = Mesh((4, 5), (2,))
    assert got["decoder.layers.2.experts.linear_fc1.weight2"] == Layout(pair, (Shard(0, stride=2),))
    assert got["decoder.layers.2.proj.weight"] == Layout(Mesh((4, 5), (2,)), (Shard(1),))
    assert got["decoder.layers.2.norm.weight"] == Layout(Mesh((4, 5), (2,)), (Replicate(),))


def test_grid_that_would_leave_the_world_falls_back_to_the_tp_group():
    model, ctx = make(1, 4, dict(ROSTERS, tp=(0, 1), dp=(1, 3), ep=(1,), expt_tp=(1,), expt_dp=(1,)))
    ctx.world = 3  # rows would be (0, 1) and (2, 3); rank 3 does not exist
    got = {s.meta.name: s.layout for s in extract_specs(model, "src", context=ctx)}
    assert got["decoder.layers.2.proj.weight"] == Layout(Mesh((0, 1), (2,)), (Shard(1),))


def test_single_rank_groups_give_a_one_rank_mesh():
    model, ctx = make(2, 4, {"tp": (2,), "dp": (2,), "ep": (2,), "expt_tp": (2,), "expt_dp": (2,)})
    layouts = {s.layout for s in extract_specs(model, "src", context=ctx)}
    assert layouts == {Layout(Mesh((2,), (1,)), (Replicate(),))}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: setattr(m.qkv.weight, "partition_sizes", [2, 2, 2]),
            "tensor 'qkv.weight': partition_sizes [2, 2, 2] sum to 6, local dim 0 is 8",
        ),
        (
            lambda m: setattr(m.decoder.layers[0].proj.weight, "partition_dim", 2),
            "tensor 'decoder.layers.2.proj.weight': partition_dim=2 is out of range for local shape (3, 2)",
        ),
        (
            lambda m: setattr(m.decoder.layers[0].proj.weight, "partition_stride", 4),
            "tensor 'decoder.layers.2.proj.weight': partition_stride=4 does not divide local dim 1 (2)",
        ),
    ],
)
def test_bad_tp_attributes(mutate, message):
    model, ctx = make(5, 8, ROSTERS)
    mutate(model)
    with pytest.raises(ExtractError) as info:
        extract_specs(model, "src", context=ctx)
    assert str(info.value) == message


def test_rank_outside_its_group_is_an_error():
    model, ctx = make(5, 8, dict(ROSTERS, tp=(4, 6)))
    with pytest.raises(ExtractError) as info:
        extract_specs(model, "src", context=ctx)
    assert str(info.value) == (
        "tensor 'decoder.layers.2.proj.weight': rank 5 is not in its tensor-parallel group (4, 6)"
    )


def test_legacy_stacked_grouped_mlp_is_refused():
    model, ctx = make(5, 8, ROSTERS)
    legacy = nn.Module()
    legacy.num_local_experts = 2
    legacy.weight1 = tp_param(3, 8, dim=1)  # with EP=1 Megatron leaves allreduce True
    model.decoder.layers[1].legacy = legacy
    with pytest.raises(ExtractError) as info:
        extract_specs(model, "src", context=ctx)
    assert str(info.value) == (
        "tensor 'decoder.layers.1.legacy.weight1': stacked expert weights (legacy GroupedMLP) are not "
        "supported; use SequentialMLP or Transformer Engine grouped-GEMM experts"
    )


def test_tp_attributes_without_any_groups_is_an_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    lin = nn.Linear(2, 4)
    lin.weight.tensor_model_parallel = True
    with pytest.raises(ExtractError) as info:
        extract_specs(lin, "src")
    assert str(info.value) == (
        "tensor 'weight' has Megatron tensor-parallel attributes but no module above it has a "
        "pg_collection and megatron.core.parallel_state is not initialised"
    )


def test_a_declaration_wins_over_megatron_attributes():
    from reshard_core.extract import declare_layout

    model, ctx = make(5, 8, ROSTERS)
    declare_layout(model.qkv.weight, dim=0, ranks=[0, 5], name="engine.qkv")  # this process is rank 0
    got = {s.meta.name: s.layout for s in extract_specs(model, "src", context=ctx)}
    assert got["engine.qkv"] == Layout(Mesh((0, 5), (2,)), (Shard(0),))
    assert "qkv.weight" not in got


def test_rank_outside_its_expert_group_is_an_error():
    model, ctx = make(5, 8, dict(ROSTERS, ep=(3, 4)))
    with pytest.raises(ExtractError) as info:
        extract_specs(model, "src", context=ctx)
    assert str(info.value) == (
        "tensor 'decoder.layers.0.experts.linear_fc1.weight0': rank 5 is not in its "
        "expert-parallel group (3, 4)"
    )


def test_te_grouped_gated_fc1_is_strided_whatever_its_partition_stride_says():
    # TE stamps grouped expert fc1 weights partition_stride=1, but with a gated MLP every rank holds
    # [gate_r; up_r]; read as stride 1, an expert-TP change would move gate rows into up rows
    rosters = dict(ROSTERS, expt_tp=(4, 5), expt_dp=(1, 5))
    model, ctx = make(5, 8, rosters, replica_grid=False)
    for layer in model.decoder.layers:
        for k in range(2):
            getattr(layer.experts.linear_fc1, f"weight{k}").partition_stride = 1
    model.config = SimpleNamespace(gated_linear_unit=True)
    got = {s.meta.name: s.layout for s in extract_specs(model, "dst", context=ctx)}
    assert got["decoder.layers.2.experts.linear_fc1.weight2"] == Layout(
        Mesh((4, 5), (2,)), (Shard(0, stride=2),)
    )
    model.config = SimpleNamespace(gated_linear_unit=False)
    _, ctx = make(5, 8, rosters, replica_grid=False)
    for name, ranks in rosters.items():
        ctx.caches[("ranks", id(getattr(model.pg_collection, name)))] = ranks
    got = {s.meta.name: s.layout for s in extract_specs(model, "dst", context=ctx)}
    assert got["decoder.layers.2.experts.linear_fc1.weight2"] == Layout(Mesh((4, 5), (2,)), (Shard(0),))
