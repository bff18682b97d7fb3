"""Usage errors a caller makes on some ranks only: one clear ``ReshardError`` on every rank, before any
data moves, and the world still usable afterwards (one 3-rank Gloo world runs every case in turn).

Rank 0 holds the source tensors ``a`` and ``b`` (8×4, distinct values); ranks 1 and 2 hold 4-row
halves of the destinations. Each case returns every rank's outcome: the error text, or ``"ok"``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.testing.world import outcome, run_world

pytestmark = pytest.mark.slow

TIMEOUT = 5.0
A = torch.arange(32.0).reshape(8, 4)
B = 100 + torch.arange(32.0).reshape(8, 4)


def _models(rank: int):
    from reshard_core import declare_layout

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.a, src.b = nn.Parameter(A.clone()), nn.Parameter(B.clone())
        for t in (src.a, src.b):
            declare_layout(t, ranks=(0,))
    else:
        dst = nn.Module()
        dst.a, dst.b = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4, 4))
        for t in (dst.a, dst.b):
            declare_layout(t, dim=0, ranks=(1, 2))
    return src, dst


def _untouched(dst) -> bool:
    return dst is None or all(not p.any() for p in dst.parameters())


def _exact(rank: int, dst) -> bool:
    rows = slice(4 * (rank - 1), 4 * rank)
    return dst is None or (torch.equal(dst.a, A[rows]) and torch.equal(dst.b, B[rows]))


def _case_options_differ(rank: int):
    import reshard_core

    src, dst = _models(rank)
    ignore = ("a",) if rank == 1 else ("b",)
    batch = 64 if rank == 2 else None
    text = outcome(
        lambda: reshard_core.refit(src, dst, ignore=ignore, max_batch_bytes=batch, timeout=TIMEOUT)
    )
    untouched = _untouched(dst)
    after = outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))
    return text, untouched, after, _exact(rank, dst)


class _Flaky:
    """A plugin (registered on one rank) whose extractor hook fails or stalls on tensor ``b``."""

    def __init__(self, how: str) -> None:
        self.how = how

    from reshard_core.hookspecs import hookimpl

    @hookimpl(tryfirst=True)
    def reshard_extract_tensor(self, qualname, tensor, owner, model, side, context):
        import time

        from reshard_core.layout import Layout
        from reshard_core.specs import TensorMeta, TensorSpec

        if qualname != "b":
            return None
        if self.how == "raise":
            raise RuntimeError("flaky extractor")
        if self.how == "foreign mesh":  # a layout that does not include this rank
            return [TensorSpec(TensorMeta("b", (8, 4), tensor.dtype), Layout.replicated((0,)), tensor)]
        time.sleep(TIMEOUT + 3)
        return None


def _with_plugin(rank: int, on_rank: int, how: str):
    """Refit with the ``_Flaky`` plugin registered on ``on_rank`` only; every rank's outcome."""
    import reshard_core
    from reshard_core.plugins import get_plugin_manager

    src, dst = _models(rank)
    pm = get_plugin_manager()
    if rank == on_rank:
        pm.register(_Flaky(how), name=f"flaky-{how.replace(' ', '-')}")
    try:
        text = outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))
    finally:
        if rank == on_rank:
            pm.unregister(name=f"flaky-{how.replace(' ', '-')}")
    return text, _untouched(dst)


def _case_hook_raises(rank: int):
    return _with_plugin(rank, 1, "raise")


def _case_foreign_mesh(rank: int):
    return _with_plugin(rank, 2, "foreign mesh")


def _case_name_collision(rank: int):
    import reshard_core

    src, dst = _models(rank)
    if rank == 1:  # a stale declaration: b now claims a's name
        reshard_core.declare_layout(dst.b, dim=0, ranks=(1, 2), name="a")
    return outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT)), _untouched(dst)


def _case_stalled_extractor(rank: int):
    """Last: rank 0 stalls in its extractor past the timeout; its peers give up and name it."""
    return _with_plugin(rank, 0, "stall")


def _case_bad_destinations(rank: int):
    """Rank 1: ``b`` is an expanded tensor; rank 2: ``a`` and ``b`` share memory, then ``a`` on meta."""
    import reshard_core

    src, dst = _models(rank)
    if rank == 1:
        dst.b = nn.Parameter(torch.zeros(1, 4).expand(4, 4), requires_grad=False)
    if rank == 2:
        dst.b = nn.Parameter(dst.a[:, :].detach(), requires_grad=False)  # same elements as a
    for t in (dst.a, dst.b) if dst is not None else ():
        reshard_core.declare_layout(t, dim=0, ranks=(1, 2))
    first = outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT)), _untouched(dst)
    if rank == 2:
        dst.a = nn.Parameter(torch.empty(4, 4, device="meta"))
        reshard_core.declare_layout(dst.a, dim=0, ranks=(1, 2))
        dst.b = nn.Parameter(torch.zeros(4, 4))
        reshard_core.declare_layout(dst.b, dim=0, ranks=(1, 2))
    return first, outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))


def _case_views_of_one_parameter(rank: int):
    """Rank 1: ``a`` and ``b`` are the even and odd columns of one parameter (disjoint elements)."""
    import reshard_core

    src, dst = _models(rank)
    if rank == 1:
        fused = torch.zeros(4, 8)
        dst.a = nn.Parameter(fused[:, 0::2], requires_grad=False)
        dst.b = nn.Parameter(fused[:, 1::2], requires_grad=False)
    for t in (dst.a, dst.b) if dst is not None else ():
        reshard_core.declare_layout(t, dim=0, ranks=(1, 2))
    return outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT)), _exact(rank, dst)


def _case_max_batch_bytes_zero(rank: int):
    import reshard_core

    src, dst = _models(rank)
    return outcome(lambda: reshard_core.refit(src, dst, max_batch_bytes=0, timeout=TIMEOUT))


def _case_cast(rank: int):
    """fp32 source into a bf16 destination (Megatron's router expert_bias: fp32 trainer, bf16 engine)."""
    import reshard_core

    src, dst = _models(rank)
    if dst is not None:
        dst.a = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
        dst.b = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
        for t in (dst.a, dst.b):
            reshard_core.declare_layout(t, dim=0, ranks=(1, 2))
    refused = outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT))
    report = reshard_core.refit(src, dst, cast=True, timeout=TIMEOUT)
    rows = slice(4 * (rank - 1), 4 * rank)
    exact = dst is None or (
        torch.equal(dst.a, A[rows].to(torch.bfloat16)) and torch.equal(dst.b, B[rows].to(torch.bfloat16))
    )
    if dst is not None:
        dst.a.data.zero_()
    session = reshard_core.prepare(src, dst, cast=True, timeout=TIMEOUT)
    session.refit()
    again = dst is None or torch.equal(dst.a, A[rows].to(torch.bfloat16))
    return refused, exact, again, report.bytes_sent, report.bytes_received


def _case_names_swapped(rank: int):
    """After a refit, the destinations swap their declared names: ``a`` now receives ``b``."""
    import reshard_core

    src, dst = _models(rank)
    session = reshard_core.prepare(src, dst, timeout=TIMEOUT)
    session.refit()
    if dst is not None:
        reshard_core.declare_layout(dst.a, dim=0, ranks=(1, 2), name="b")
        reshard_core.declare_layout(dst.b, dim=0, ranks=(1, 2), name="a")
    fast = outcome(session.refit)  # collective: the source-only rank, unchanged, joins and raises too
    reshard_core.refit(src, dst, timeout=TIMEOUT)
    rows = slice(4 * (rank - 1), 4 * rank)
    return fast, dst is None or (torch.equal(dst.a, B[rows]) and torch.equal(dst.b, A[rows]))


def _case_double_coverage(rank: int):
    """Ranks 1 and 2 list the destination mesh of ``w`` in opposite orders: each claims rows 0-3
    (and nobody rows 4-7). Both layouts are reported, so only the holding digests can tell."""
    import reshard_core

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(A.clone())
        reshard_core.declare_layout(src.w, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w = nn.Parameter(torch.zeros(4, 4))
        reshard_core.declare_layout(dst.w, dim=0, ranks=(1, 2) if rank == 1 else (2, 1))
    return outcome(lambda: reshard_core.refit(src, dst, timeout=TIMEOUT)), _untouched(dst)


CASES = {
    "double_coverage": _case_double_coverage,
    "names_swapped": _case_names_swapped,
    "max_batch_bytes_zero": _case_max_batch_bytes_zero,
    "cast": _case_cast,
    "bad_destinations": _case_bad_destinations,
    "views_of_one_parameter": _case_views_of_one_parameter,
    "options_differ": _case_options_differ,
    "hook_raises": _case_hook_raises,
    "foreign_mesh": _case_foreign_mesh,
    "name_collision": _case_name_collision,
    "stalled_extractor": _case_stalled_extractor,
}


def _world(rank: int, world: int, names: list[str]):
    return {name: CASES[name](rank) for name in names}


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_world(_world, 3, list(CASES), timeout=180)
    return {name: [r[name] for r in per_rank] for name in CASES}


def test_ranks_passing_different_plan_options_all_fail_naming_the_options_before_data_moves(outcomes):
    want = (
        "ReshardError: refit options differ across ranks: ignore (ranks [0, 2] vs ranks [1]); "
        "max_batch_bytes (ranks [0, 1] vs ranks [2]); every rank must pass the same ignore=, tied=, "
        "max_batch_bytes=, transport=, cast=, verify= and delta= (they shape the plan and its execution)"
    )
    assert outcomes["options_differ"] == [(want, True, "ok", True)] * 3


@pytest.mark.parametrize(
    "case, text",
    [
        (
            "hook_raises",
            "PlanError: rank [1]: the reshard_extract_tensor hook of plugin 'flaky-raise' raised on dst "
            "tensor 'b': RuntimeError: flaky extractor",
        ),
        ("foreign_mesh", "PlanError: rank [2]: tensor 'b': rank 2 is not in the mesh (0,) of its layout"),
        ("name_collision", "PlanError: rank [1]: tensors 'a' and 'b' both resolve to canonical name 'a'"),
    ],
)
def test_a_failure_on_one_rank_before_the_exchange_fails_every_rank_the_same_way(outcomes, case, text):
    assert outcomes[case] == [(text, True)] * 3


def test_two_layouts_claiming_one_rank_name_the_tensor_the_rank_and_both_layouts(outcomes):
    from reshard_core.exchange.contribute import contributor
    from reshard_core.layout import Layout, Mesh, Shard

    # the case needs each layout described by a rank that holds it (else it is "did not report")
    assert [contributor("dst", "w", Layout(Mesh.of(r), (Shard(0),))) for r in ((1, 2), (2, 1))] == [1, 2]
    one, two = "mesh (2,) on ranks [1, 2] (Shard(0))", "mesh (2,) on ranks [2, 1] (Shard(0))"
    want = (
        "PlanError: layout exchange: ranks disagree about their holdings: "
        f"w: rank 2 reports a destination layout {two} that includes rank 1, which holds it in layout {one}; "
        f"w: rank 1 reports a destination layout {one} that includes rank 2, which holds it in layout {two}"
    )
    assert outcomes["double_coverage"] == [(want, True)] * 3


def test_a_rank_stalled_before_the_exchange_is_named_by_its_peers_within_the_timeout(outcomes):
    stalled, *peers = outcomes["stalled_extractor"]
    assert peers == [
        (
            f"TransportError: rank {r}: refit could not start: rank [0] of [0-2] did not join within 5 s "
            "(failed, exited or stalled): timed out after 5 s",
            True,
        )
        for r in (1, 2)
    ]
    # its peers left: it fails in whichever round it reaches first once it wakes up
    assert stalled[0].startswith("TransportError: rank 0: "), stalled
    assert "(failed, exited or stalled)" in stalled[0], stalled


def test_destinations_that_cannot_be_written_fail_every_rank_before_data_moves(outcomes):
    expanded = (
        "destination tensor 'b' on rank 1 is expanded (stride 0 along dim 0): many of its elements share "
        "one memory cell; give it its own storage (e.g. .clone())"
    )
    shared = (
        "destination tensors 'a' and 'b' on rank 2 share memory (writing one overwrites the other); "
        "give each its own storage"
    )
    meta = (
        "destination tensor 'a' on rank 2 is on the meta device (it has no storage to write into); "
        "materialise the model first (e.g. to_empty() and initialise it)"
    )
    first = f"PlanError: rank [1]: {expanded}; rank [2]: {shared}"
    then = f"PlanError: rank [1]: {expanded}; rank [2]: {meta}"
    assert [(f[0], r) for f, r in outcomes["bad_destinations"]] == [(first, then)] * 3
    assert all(f[1] for f, _ in outcomes["bad_destinations"])  # nothing was written


def test_disjoint_views_of_one_parameter_are_valid_destinations(outcomes):
    assert outcomes["views_of_one_parameter"] == [("ok", True)] * 3


def test_a_non_positive_max_batch_bytes_is_a_reshard_error_naming_the_option(outcomes):
    want = "ReshardError: max_batch_bytes must be a positive number of bytes or None, got 0"
    assert outcomes["max_batch_bytes_zero"] == [want] * 3


def test_cast_converts_an_fp32_source_into_a_bf16_destination_on_the_sender(outcomes):
    refused = (
        "PlanError: 2 tensors differ only in dtype, source float32 vs destination bfloat16: a, b; "
        "pass cast=True to convert on the way (the sender converts)"
    )
    # two 4×4 halves of two tensors leave rank 0 in bf16: 2 bytes an element on the wire
    assert outcomes["cast"] == [
        (refused, True, True, 128, 0),
        (refused, True, True, 0, 64),
        (refused, True, True, 0, 64),
    ]


def test_swapping_declared_names_rebuilds_the_plan(outcomes):
    stale = (
        "ReshardError: ranks [1, 2]: the prepared session no longer fits its models (a tensor was "
        "replaced, reshaped, moved or re-laid out); call reshard_core.prepare() again on every rank"
    )
    assert outcomes["names_swapped"] == [(stale, True)] * 3
