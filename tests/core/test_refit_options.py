"""``RefitOptions``: one frozen object holding every choice of a refit, passed whole.

Unit checks of the object (amending, refusing an unknown choice, frozen), the planner taking it
whole, and a 3-rank Gloo world where ``refit(src, dst, RefitOptions(...))`` and the same choices as
keywords move the same bytes to the same result, and keywords amend a given object.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from reshard_core import RefitOptions
from reshard_core.exchange.option_digests import option_digests
from reshard_core.layout import Layout, Mesh, Replicate
from reshard_core.plan.plan_options import PlanOptions
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import TableBuilder
from reshard_core.specs import TensorMeta
from reshard_core.testing.world import run_world


def test_of_amends_a_given_object_and_defaults_without_one():
    base = RefitOptions(verify=True, ignore=("x.*",))
    amended = RefitOptions.of(base, delta=True, max_batch_bytes=64)
    assert amended == RefitOptions(verify=True, ignore=("x.*",), delta=True, max_batch_bytes=64)
    assert RefitOptions.of(None, cast=True) == RefitOptions(cast=True)
    assert RefitOptions.of(base) is base


def test_an_unknown_choice_is_refused_by_name():
    with pytest.raises(TypeError, match="tiedd"):
        RefitOptions.of(None, tiedd={"a": "b"})
    with pytest.raises(TypeError):
        RefitOptions("nccl")  # keyword only: a positional value would land in the wrong field


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RefitOptions().delta = True


def test_refit_options_are_plan_options_and_digest_by_value():
    assert isinstance(RefitOptions(), PlanOptions)
    assert option_digests(RefitOptions(ignore=["a", "b"])) == option_digests(RefitOptions(ignore=("b", "a")))
    assert option_digests(RefitOptions(delta=True)) != option_digests(RefitOptions())


def test_the_planner_takes_refit_options_whole():
    builder = TableBuilder()
    for name in ("a", "b"):
        meta = TensorMeta(name, (4,), torch.float32)
        builder.add("src", 0, meta, Layout(Mesh.of([0]), (Replicate(),)))
        builder.add("dst", 1, meta, Layout(Mesh.of([1, 2, 3, 4]), (Replicate(),)))
    table = builder.build()
    whole = plan_rank(table, 0, RefitOptions(max_batch_bytes=64, transport="nccl", verify=True))
    assert whole == plan_rank(table, 0, max_batch_bytes=64)
    assert whole.num_batches == 2 and plan_rank(table, 0).num_batches == 1


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core import declare_layout

    src, dst = None, None
    full = torch.arange(64.0).reshape(16, 4)
    if rank == 0:
        src = nn.Module()
        src.w, src.v = nn.Parameter(full.clone()), nn.Parameter(-full)
        declare_layout(src.w, ranks=(0,))
        declare_layout(src.v, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w, dst.v = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.zeros(8, 4))
        declare_layout(dst.w, dim=0, ranks=(1, 2))
        declare_layout(dst.v, dim=0, ranks=(1, 2))
    options = reshard_core.RefitOptions(timeout=10, max_batch_bytes=64)
    by_object = reshard_core.refit(src, dst, options)
    if dst is not None:
        dst.w.data.zero_()
        dst.v.data.zero_()
    by_keywords = reshard_core.refit(src, dst, timeout=10, max_batch_bytes=64)
    amended = reshard_core.refit(src, dst, options, verify=True)
    session = reshard_core.prepare(src, dst, options, verify=True)
    return {
        "exact": dst is None
        or (torch.equal(dst.w, full[(rank - 1) * 8 : rank * 8]) and torch.equal(dst.v, -dst.w)),
        "moved": [(r.bytes_sent, r.bytes_received, r.batches) for r in (by_object, by_keywords)],
        "reused": by_keywords.reused_plan,
        "verified": amended.verified_bytes,
        "session options": session.options == reshard_core.RefitOptions.of(options, verify=True),
    }


@pytest.mark.slow
def test_an_options_object_and_keywords_are_the_same_refit():
    results = run_world(_world, 3, timeout=120)
    assert [r["exact"] for r in results] == [True, True, True]
    assert results[0]["moved"] == [(512, 0, 2), (512, 0, 2)]  # max_batch_bytes=64: one tensor a batch
    assert results[1]["moved"] == [(0, 256, 2), (0, 256, 2)]
    assert [r["reused"] for r in results] == [True, True, True]
    assert [r["verified"] for r in results] == [0, 256, 256]
    assert [r["session options"] for r in results] == [True, True, True]
