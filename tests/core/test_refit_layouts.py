"""``refit`` on real PyTorch layouts in one 5-rank Gloo world, every destination element checked.

- FSDP2 ``fully_shard`` over ranks 0-3 (``fc1`` has 33 rows: shards 9, 9, 9, 6) → DTensor TP4
  (``parallelize_module``) and → TP2×FSDP2 (``_StridedShard``), checked against ``full_tensor()`` of
  the source and of a fresh model from the same seed; rank 4 takes part passing ``None, None``.
- Non-colocated: the pure-torch GPT held Megatron-style (TP2) on ranks 0-1 → declared TP2 on ranks
  2-3, rank 4 idle; undeclared plain tensors on both sides; a byte budget below the model's size.
- The session cache: a re-declared layout or a new shape on the same model object misses the cache
  (a stale plan would write the wrong rows); storage is kept. ``Session.refit()`` (no agreement
  round) lands the same values and refuses a changed or collected model before any data moves.
- Bad input: a destination-only name is a ``PlanError`` naming it on every rank; ``ignore=`` opts out.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from reshard_core.errors import PlanError, ReshardError
from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

WORLD = 5
FSDP_RANKS = 4


def _full(model) -> dict[str, torch.Tensor]:
    """Every weight as a full tensor (``full_tensor()`` of DTensors, a collective)."""
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone())
            for n, t in [*model.named_parameters(), *model.named_buffers()]}  # fmt: skip


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def _dtensor_cases(rank: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    import reshard_core
    from reshard_core.testing.models import TinyMLP, build_fsdp_mlp, build_tp_mlp

    mesh = DeviceMesh("cpu", torch.arange(FSDP_RANKS))
    mesh2d = DeviceMesh("cpu", torch.arange(FSDP_RANKS).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    inside = rank < FSDP_RANKS
    src = build_fsdp_mlp(mesh, seed=3, ffn=33) if inside else None
    out = {}
    for case, build in (("fsdp4->tp4", lambda s: build_tp_mlp(mesh, seed=s, ffn=33)),
                        ("fsdp4->tp2xfsdp2", lambda s: build_tp_mlp(mesh2d["tp"], seed=s, ffn=33,
                                                                    fsdp_mesh=mesh2d["dp"]))):  # fmt: skip
        dst = build(4) if inside else None
        reports = [reshard_core.refit(src, dst, timeout=60)]
        if inside:
            fresh = TinyMLP(64, 33, seed=3)
            reference = {**dict(fresh.named_parameters()), **dict(fresh.named_buffers())}
            pointers = [t.to_local().data_ptr() if hasattr(t, "to_local") else t.data_ptr()
                        for t in dst.parameters()]  # fmt: skip
            first = _full(dst)
            with torch.no_grad():
                for t in dst.parameters():
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
        reports.append(reshard_core.refit(src, dst, timeout=60))
        if inside:
            kept = pointers == [t.to_local().data_ptr() if hasattr(t, "to_local") else t.data_ptr()
                                for t in dst.parameters()]  # fmt: skip
            out[case] = {
                "vs_source": _same(first, _full(src)),
                "vs_reference": _same(first, {n: t.detach() for n, t in reference.items()}),
                "second": _same(_full(dst), _full(src)),
                "placements": str(dst.fc1.weight.placements),
                "src_local_rows": src.fc1.weight.to_local().shape[0],
                "kept": kept,
            }
        out.setdefault(case, {})["reused"] = [r.reused_plan for r in reports]
    return out


def _noncolocated_cases(rank: int) -> dict:
    from reshard_bench.gpt import PRESETS
    from reshard_bench.layouts import build_model, check_model

    import reshard_core
    from reshard_core.simulate.parallel import Parallel

    config = PRESETS["tiny"]
    src = build_model(config, Parallel(tp=2), "src", seed=11, dtype=torch.bfloat16, offset=0)
    dst = build_model(config, Parallel(tp=2), "dst", seed=12, dtype=torch.bfloat16, offset=2)
    out = {"before": len(check_model(dst, 11))}
    report = reshard_core.refit(src.model, dst.model, timeout=60)
    out["after"] = check_model(dst, 11) + [f"source {p}" for p in check_model(src, 11)]
    out["report"] = (report.bytes_sent, report.bytes_received, report.bytes_local, report.batches)
    with torch.no_grad():
        for h in dst.holdings:
            h.tensor.zero_()
    budget = 4096
    report = reshard_core.refit(src.model, dst.model, max_batch_bytes=budget, timeout=60)
    out["budget"] = {"batches": report.batches, "after": check_model(dst, 11),
                     "model_bytes": config.nbytes(torch.bfloat16)}  # fmt: skip
    # undeclared plain tensors: replicated over the ranks that pass a model on that side
    torch.manual_seed(5)
    plain_src = nn.Linear(8, 6)
    plain_dst = nn.Linear(8, 6)
    with torch.no_grad():
        plain_dst.weight.zero_()
        plain_dst.bias.zero_()
    report = reshard_core.refit(plain_src if rank < 2 else None, plain_dst if rank in (2, 3) else None)
    out["plain"] = (_same(_full(plain_src), _full(plain_dst)) if rank in (2, 3) else None, report.bytes_sent)
    return out


def _cache_cases(rank: int) -> dict:
    """A replicated source, a destination declared Shard(0) over ranks 0-3; then re-declared."""
    import reshard_core
    from reshard_core import session_cache as api

    ranks = (0, 1, 2, 3)
    full = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    src = dst = None
    out = {}
    if rank < 4:
        src, dst = nn.Module(), nn.Module()
        src.weight = nn.Parameter(full.clone())
        dst.weight = nn.Parameter(torch.zeros(3, 8))
        reshard_core.declare_layout(dst.weight, dim=0, ranks=ranks)
    reports = [reshard_core.refit(src, dst) for _ in range(2)]
    rows = lambda order: full[3 * order.index(rank) : 3 * order.index(rank) + 3]  # noqa: E731
    session = reshard_core.prepare(src, dst)  # the cached session; Session.refit() skips the agreement
    if dst is not None:
        out["first"] = torch.equal(dst.weight, rows(ranks))
        dst.weight.data.zero_()
    fast = session.refit()
    if dst is not None:
        out["fast"] = torch.equal(dst.weight, rows(ranks)) and fast.reused_plan
        ptr = dst.weight.data_ptr()
        reshard_core.declare_layout(dst.weight, dim=0, ranks=ranks[::-1])  # same shapes, other rows
        dst.weight.data.zero_()
    out["stale"] = _error_of(session.refit)  # every rank holding a model sees the change itself
    if dst is not None:
        out["stale_untouched"] = bool((dst.weight == 0).all())
    reports.append(reshard_core.refit(src, dst))
    session = reshard_core.prepare(src, dst)  # the rebuilt session
    if dst is not None:
        out["redeclared"] = torch.equal(dst.weight, rows(ranks[::-1]))
        out["kept"] = ptr == dst.weight.data_ptr()
        dst.weight = nn.Parameter(torch.zeros(12, 8))  # a new shape: replicated, undeclared
    out["replaced"] = _error_of(session.refit)  # collective: the idle rank joins too
    reports.append(reshard_core.refit(src, dst))
    if dst is not None:
        out["reshaped"] = torch.equal(dst.weight, full)
    out["reused"] = [r.reused_plan for r in reports]
    # a session holds its models weakly: once one is collected the session goes, so a new model
    # that happens to get the dead one's id can never pick up its plan
    if dst is not None:
        keys = [k for k, c in api._sessions.items() if any(ref() is dst for ref in c.session.models)]
        del src, dst
        gc.collect()
        out["dropped"] = len(keys) == 1 and keys[0] not in api._sessions
    out["collected"] = _error_of(session.refit)
    return out


def _error_of(call) -> str | None:
    try:
        call()
    except ReshardError as exc:
        return str(exc)
    return None


def _swapped_submodule_case(rank: int) -> tuple[str | None, bool]:
    """Every rank holds both (replicated) models; a swapped submodule makes ``Session.refit`` refuse."""
    import reshard_core

    torch.manual_seed(4)
    src, dst = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    session = reshard_core.prepare(src, dst)
    session.refit()
    assert torch.equal(dst[0].weight, src[0].weight)
    dst[0] = nn.Linear(4, 4)  # its old tensors still exist, but are no longer the model's
    error = _error_of(session.refit)
    dst[0].root = [dst]  # a back-reference to the root, as framework state often holds
    model = weakref.ref(dst)
    del dst
    gc.collect()
    return error, model() is None  # the session does not keep its model alive


def _bad_input_cases(rank: int) -> dict:
    import reshard_core

    torch.manual_seed(9)
    src = nn.Linear(8, 4)
    dst = nn.Linear(8, 4)
    dst.register_parameter("extra", nn.Parameter(torch.full((3,), 2.0)))
    with torch.no_grad():
        dst.weight.zero_()
    try:
        reshard_core.refit(src, dst)
        error = None
    except PlanError as exc:
        error = str(exc)
    untouched = bool((dst.weight == 0).all())
    reshard_core.refit(src, dst, ignore=["extra"])
    return {
        "error": error,
        "untouched": untouched,
        "ignored": torch.equal(dst.weight, src.weight) and bool((dst.extra == 2.0).all()),
    }


def _world(rank: int, world: int) -> dict:
    import reshard_core

    out = {
        "dtensor": _dtensor_cases(rank),
        "noncolocated": _noncolocated_cases(rank),
        "cache": _cache_cases(rank),
        "swapped": _swapped_submodule_case(rank),
        "bad": _bad_input_cases(rank),
    }
    reshard_core.clear_caches()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=300, pg_timeout=120)


@pytest.mark.parametrize("case", ["fsdp4->tp4", "fsdp4->tp2xfsdp2"])
def test_fsdp2_to_dtensor_tp_equals_the_source_full_tensor(results, case):
    placements = {
        "fsdp4->tp4": "(Shard(dim=0),)",
        "fsdp4->tp2xfsdp2": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    }
    for rank in range(FSDP_RANKS):
        facts = results[rank]["dtensor"][case]
        assert facts["vs_source"] == [] and facts["vs_reference"] == [] and facts["second"] == []
        assert facts["placements"] == placements[case]
        assert facts["src_local_rows"] == (6 if rank == 3 else 9)  # uneven FSDP2 shards
        assert facts["kept"]
    for rank in range(WORLD):  # rank 4 takes part with None, None and agrees on the cache
        assert results[rank]["dtensor"][case]["reused"] == [False, True]


def test_noncolocated_refit_with_an_idle_rank_is_exact(results):
    for rank in (2, 3):
        facts = results[rank]["noncolocated"]
        assert facts["before"] > 0  # the destination started from other values
        assert facts["after"] == []
    sent = [results[r]["noncolocated"]["report"][0] for r in range(WORLD)]
    received = [results[r]["noncolocated"]["report"][1] for r in range(WORLD)]
    local = [results[r]["noncolocated"]["report"][2] for r in range(WORLD)]
    assert sent[0] > 0 and sent[1] > 0 and sent[2:] == [0, 0, 0]
    assert received[:2] == [0, 0] and received[4] == 0 and received[2] > 0 and received[3] > 0
    assert sum(sent) == sum(received) and local == [0] * WORLD


def test_a_budget_below_the_model_size_splits_into_batches_and_stays_exact(results):
    for rank in (2, 3):
        facts = results[rank]["noncolocated"]["budget"]
        assert facts["model_bytes"] > 4096
        assert facts["batches"] > 1
        assert facts["after"] == []


def test_undeclared_plain_tensors_replicate_over_the_ranks_passing_that_side(results):
    for rank in (2, 3):
        assert results[rank]["noncolocated"]["plain"][0] == []
    senders = [r for r in range(WORLD) if results[r]["noncolocated"]["plain"][1] > 0]
    assert senders == [0, 1]


def test_a_changed_layout_or_shape_misses_the_cache_and_lands_right(results):
    for rank in range(4):
        facts = results[rank]["cache"]
        assert facts["first"] and facts["redeclared"] and facts["reshaped"] and facts["kept"]
        assert facts["dropped"]
    for rank in range(WORLD):
        assert results[rank]["cache"]["reused"] == [False, True, False, False]


def test_a_prepared_session_refits_without_agreement_and_refuses_changed_models(results):
    stale = (
        "ranks [0-3]: the prepared session no longer fits its models (a tensor was replaced, "
        "reshaped, moved or re-laid out); call reshard_core.prepare() again on every rank"
    )
    for rank in range(4):
        facts = results[rank]["cache"]
        assert facts["fast"]
        assert facts["stale_untouched"]  # refused before any data moved
    for rank in range(WORLD):  # the idle rank holds no model, and raises the others' error alike
        facts = results[rank]["cache"]
        assert facts["stale"] == stale
        assert facts["replaced"] == facts["stale"]  # a parameter object swapped for another
        assert facts["collected"] == (
            "ranks [0-3]: the prepared session no longer fits its models (a model it was prepared "
            "for was garbage collected); call reshard_core.prepare() again on every rank"
        )
        assert results[rank]["swapped"] == (
            "ranks [0-4]: the prepared session no longer fits its models (a submodule was replaced, "
            "added or removed); call reshard_core.prepare() again on every rank",
            True,
        )


def test_an_unmatched_name_is_a_plan_error_on_every_rank_and_ignore_opts_out(results):
    expected = (
        "extra: on the destination only (ranks [0-4]), no source holds it; pass ignore=['extra'] to "
        "leave it out, or tied= to feed it from another tensor"
    )
    for rank in range(WORLD):
        facts = results[rank]["bad"]
        assert facts["error"] == expected
        assert facts["untouched"]  # nothing moved before the error
        assert facts["ignored"]
