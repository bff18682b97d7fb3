"""Megatron corner cases from Megatron's own test scenarios (CPU, Gloo worlds of 2 ranks).

Tied embeddings under PP>1: the last stage holds its own ``output_layer.weight``, a copy of
``embedding.word_embeddings.weight``; a refit between tied PP2 and tied PP1 (which has no
``output_layer.weight``) needs no ``ignore=`` or ``tied=``. Each destination must equal, bit for
bit, a reference built by Megatron from the source's seed in the destination layout.

Also: experts under EP=1 (``allreduce=True``) split over expert TP, and DTensor's non-default
``shard_order`` (honoured exactly, or refused when it contradicts the placements); and a prepared
session whose source changes its ``partition_stride`` or ``partition_dim`` (never served the old plan).
"""

from __future__ import annotations

import pytest
import torch

from reshard_core.testing.world import outcome, run_world

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

KWARGS = dict(num_layers=2, tied=True)
CASES = {"tied pp2->pp1": ((1, 2, 1), (1, 1, 1)), "tied pp1->pp2": ((1, 1, 1), (1, 2, 1))}


def _tied_gpt(layout: tuple[int, int, int], seed: int):
    """``build_gpt(tied=True)`` in ``layout``; with PP>1 the last stage's output layer is then made
    the first stage's embedding again, as Megatron's constructor does (zero it, all-reduce)."""
    import torch.distributed as dist

    from reshard_core.testing.models import build_gpt, build_pg_collection

    pgs = build_pg_collection(*layout)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied PP>1 constructor all-reduces on "cuda"
    try:
        model = build_gpt(pgs, seed=seed, **KWARGS)
    finally:
        torch.Tensor.cuda = cuda
    if pgs.pp.size() > 1:
        weight = model.shared_embedding_or_output_weight()
        with torch.no_grad():
            if not model.pre_process:
                weight.zero_()
            dist.all_reduce(weight.data, group=pgs.embd)
    return model


def _weights(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.testing.models import init_megatron

    init_megatron()
    out = {}
    for name, (src_layout, dst_layout) in CASES.items():
        src = _tied_gpt(src_layout, seed=7)
        dst = _tied_gpt(dst_layout, seed=8)
        reference = _tied_gpt(dst_layout, seed=7)
        got, want = _weights(dst), _weights(reference)
        before = sorted(n for n in want if not torch.equal(got[n], want[n]))
        reshard_core.refit(src, dst, timeout=60)
        out[name] = {
            "names": sorted(got),
            "before": before,
            "after": sorted(n for n in want if not torch.equal(got[n], want[n])),
            "tied_equal": torch.equal(
                dst.shared_embedding_or_output_weight(),
                want.get("embedding.word_embeddings.weight", want.get("output_layer.weight")),
            ),
        }
    reshard_core.clear_caches()
    return out


def test_tied_embeddings_refit_between_pp2_and_pp1_without_options():
    results = run_world(_world, 2, timeout=240)
    for name, (_, dst_layout) in CASES.items():
        last = results[1][name]
        if dst_layout[1] == 2:  # the last stage of the destination holds the tied copy
            assert "output_layer.weight" in last["names"]
            assert "output_layer.weight" in last["before"]
        for rank in range(2):
            got = results[rank][name]
            assert got["before"], (name, rank)
            assert got["after"] == [], (name, rank)
            assert got["tied_equal"], (name, rank)


def test_experts_split_over_expert_tp_even_with_allreduce_true():
    """EP=1 with expert TP 1 and dense TP 2 (rank 1 of 2): Megatron leaves ``allreduce=True`` on the
    experts, which must still split over ``expt_tp`` and replicate over ``expt_dp``."""
    from types import SimpleNamespace

    from torch import nn

    from reshard_core.extract import ExtractContext, extract_specs
    from reshard_core.layout import Layout, Mesh, Replicate, Shard

    def tp_param() -> nn.Parameter:
        p = nn.Parameter(torch.zeros(4, 3))
        p.tensor_model_parallel, p.partition_dim, p.partition_stride, p.allreduce = True, 0, 1, True
        return p

    rosters = {"tp": (0, 1), "dp": (1,), "ep": (1,), "expt_tp": (1,), "expt_dp": (0, 1)}
    groups = {name: object() for name in rosters}
    ctx = ExtractContext(rank=1, world=2)
    for name, ranks in rosters.items():
        ctx.caches[("ranks", id(groups[name]))] = ranks
    model = nn.Module()
    model.pg_collection = SimpleNamespace(**groups)
    model.mlp = nn.Module()
    model.mlp.experts = nn.Module()
    model.mlp.experts.linear_fc1 = nn.Module()
    model.mlp.experts.linear_fc1.weight = tp_param()
    model.mlp.shared_experts = nn.Module()
    model.mlp.shared_experts.weight = tp_param()
    got = {s.meta.name: (s.meta.shape, s.layout) for s in extract_specs(model, "src", context=ctx)}
    assert got == {
        "mlp.experts.linear_fc1.weight": ((4, 3), Layout(Mesh((0, 1), (2,)), (Replicate(),))),
        "mlp.shared_experts.weight": ((8, 3), Layout(Mesh((0, 1), (2,)), (Shard(0),))),
    }


def _order(*entries):
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    return tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=m) for d, m in entries)


def test_dtensor_non_default_shard_order_is_honoured_exactly():
    """Dim 0 of a (10, 3) tensor split over mesh dim 1 first, then mesh dim 0 (uneven both times):
    the rank at mesh coordinate (i, j) holds ``chunk(chunk(rows, 2)[j], 2)[i]`` — and with the
    default order ``chunk(chunk(rows, 2)[i], 2)[j]``."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard as DShard

    from reshard_core.extract.dtensor import dtensor_layout

    mesh = SimpleNamespace(mesh=torch.arange(8, 12).reshape(2, 2))
    rows = torch.arange(10)
    placements = (DShard(0), DShard(0))
    for order, outer in ((_order((0, (1, 0))), 1), (_order((0, (0, 1))), 0), (None, 0)):
        layout = dtensor_layout("w", (10, 3), mesh, placements, order)
        for i in range(2):
            for j in range(2):
                coord = (i, j)
                want = torch.chunk(torch.chunk(rows, 2)[coord[outer]], 2)[coord[1 - outer]]
                ((lo, hi),) = layout.dim_intervals((10, 3), int(mesh.mesh[i, j]))[0]
                assert rows[lo:hi].tolist() == want.tolist(), (order, coord)


def test_dtensor_shard_order_that_contradicts_its_placements_is_refused():
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard

    from reshard_core.extract import ExtractError
    from reshard_core.extract.dtensor import dtensor_layout

    mesh = SimpleNamespace(mesh=torch.arange(4).reshape(2, 2))
    with pytest.raises(ExtractError) as err:
        dtensor_layout("w", (8, 4), mesh, (DShard(0), DReplicate()), _order((0, (1, 0))))
    assert str(err.value) == (
        "tensor 'w': shard_order entry (tensor dim 0, mesh dims [1, 0]) does not match its placements "
        "(Shard(dim=0), Replicate())"
    )


def _flip_world(rank: int, world: int) -> dict:
    """A prepared TP2 -> TP1 session, then the source's partition attributes change under it."""
    import torch.distributed as dist

    import reshard_core
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    init_megatron()
    src = build_gpt(build_pg_collection(2, 1, 1), seed=7, num_layers=1)
    dst = build_gpt(build_pg_collection(1, 1, 1), seed=8, num_layers=1)
    session = reshard_core.prepare(src, dst, timeout=60)
    session.refit()
    out = {}
    # partition_stride: same global shape, other rows; a reused plan would write the old order
    fc1 = src.decoder.layers[0].mlp.linear_fc1.weight
    old_stride = fc1.partition_stride
    fc1.partition_stride = 1 if old_stride == 2 else 2
    out["stride_session"] = outcome(session.refit)
    out["stride_refit"] = outcome(lambda: reshard_core.refit(src, dst, timeout=60))
    pieces = [torch.empty_like(fc1) for _ in range(world)]
    dist.all_gather(pieces, fc1.detach())
    chunks = [p.chunk(fc1.partition_stride) for p in pieces]
    want = torch.cat([c[k] for k in range(fc1.partition_stride) for c in chunks])
    out["stride_exact"] = torch.equal(dst.decoder.layers[0].mlp.linear_fc1.weight, want)
    fc1.partition_stride = old_stride
    # partition_dim: the global shape changes, so the new plan is refused naming the tensor
    proj = src.decoder.layers[0].self_attention.linear_proj.weight
    proj.partition_dim = 0
    out["dim_session"] = outcome(session.refit)
    out["dim_refit"] = outcome(lambda: reshard_core.refit(src, dst, timeout=60))
    reshard_core.clear_caches()
    return out


def test_changed_megatron_partition_attributes_are_never_served_a_stale_plan():
    results = run_world(_flip_world, 2, timeout=240)
    stale = (  # both ranks' models changed: every rank raises both ranks' (equal) error
        "ReshardError: ranks [0, 1]: the prepared session no longer fits its models (a tensor was "
        "replaced, reshaped, moved or re-laid out); call reshard_core.prepare() again on every rank"
    )
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    shapes = (
        f"PlanError: {proj}: source shape (128, 32) float32 on ranks [0, 1] but destination shape (64, 64) "
        "float32 on ranks [0, 1]"
    )
    for rank, got in enumerate(results):
        assert got == {
            "stride_session": stale,
            "stride_refit": "ok",
            "stride_exact": True,
            "dim_session": stale,
            "dim_refit": shapes,
        }, rank
