"""One rank fails on its own; every rank raises within ``timeout`` + 1 s, naming it and its reason.

3-rank Gloo worlds: rank 0 holds the (8, 4) source, ranks 1 and 2 hold 4-row halves of the
destination. One rank breaks in one way per case:

- before it joins: a destination that is no module, a lazy (uninitialised) parameter (the rank
  joins the agreement round all the same, carrying its error: every rank raises its text), an
  extractor plugin that returns garbage (named by its plugin name);
- during the data movement: a transform whose ``prepare_send`` raises on the sending rank;
- by stalling: before the refit starts (it never joins), and inside the transport.

A failing rank publishes its error in the group's store before it leaves; the others read it
while they wait and raise at once with that rank's own text. A stalled rank publishes nothing: the
others raise at the timeout, naming it as the rank that did not join. Each rank reports
``(seconds it spent in the refit, its error)``.
"""

from __future__ import annotations

import time

import pytest
import torch
from three_ranks import models
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

TIMEOUT = 3.0
SLACK = 1.0  # every healthy rank raises within TIMEOUT + SLACK
AT_ONCE = TIMEOUT / 2  # a published failure ends the peers' waits long before the timeout


class _Garbage:
    """An extractor plugin that answers a string for every tensor."""

    from reshard_core import hookimpl

    @hookimpl(tryfirst=True)
    def reshard_extract_tensor(self, qualname, tensor, owner, model, side, context):
        return "garbage"


def _failing_transform():
    from reshard_core.transform import ReshardTransform

    class Failing(ReshardTransform):
        def should_transform(self, name: str) -> bool:
            return True

        def prepare_send(self, name, op, src_view):
            raise ValueError("the wire format cannot hold NaN here")

        def prepare_recv(self, name, op):
            return [torch.empty(op.numel, dtype=torch.float32)]

        def finalize_recv(self, name, op, buffers):
            pass

    return Failing()


def _break(rank: int, how: str, src, dst):
    """This rank's models and refit options after breaking it ``how`` (rank 0 or 2 breaks)."""
    import reshard_core

    options: dict = {}
    if how == "not_a_module" and rank == 2:
        dst = 42
    if how == "lazy" and rank == 2:
        dst = nn.Module()
        dst.w = nn.parameter.UninitializedParameter()
    if how == "garbage_extractor":
        reshard_core.clear_caches()  # every rank extracts again; rank 2 meets the plugin
        if rank == 2:
            reshard_core.register_plugin(_Garbage(), name="garbage-extractor")
    if how == "transform_raises":
        options["transform"] = _failing_transform()
    if how == "stall_before" and rank == 0:
        time.sleep(TIMEOUT + 3)
    if how == "stall_in_transport" and rank == 0:
        from reshard_gloo.transport import GlooCopyService

        original = GlooCopyService.start

        def start(self):
            time.sleep(TIMEOUT + 3)
            return original(self)

        GlooCopyService.start = start
    return src, dst, options


def _world(rank: int, world: int, how: str):
    import reshard_core

    src, dst = models(rank)
    reshard_core.refit(src, dst, timeout=TIMEOUT)  # one good refit: the transport is warm
    src, dst, options = _break(rank, how, src, dst)
    start = time.monotonic()
    try:
        reshard_core.refit(src, dst, timeout=TIMEOUT, **options)
    except Exception as exc:  # noqa: BLE001 - the text and the time are what the test checks
        outcome = time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    else:
        outcome = time.monotonic() - start, "no error"
    # Stay a moment, as a training loop would: the store (and the records on it) lives in rank 0's
    # process, so peers cannot read rank 0's words once it has exited.
    time.sleep(1.0)
    return outcome


def _run(how: str) -> list[tuple[float, str]]:
    return run_world(_world, 3, how, timeout=120, pg_timeout=60)


def _healthy_in_time(results, failed: int) -> None:
    for rank, (seconds, _) in enumerate(results):
        if rank != failed:
            assert seconds < TIMEOUT + SLACK, (rank, seconds)


def test_a_destination_that_is_no_module_is_named_on_every_rank_at_once():
    """Rank 2's own check fails before the agreement round; it joins the round with its error, and
    every rank (rank 2 too) raises that rank's text."""
    results = _run("not_a_module")
    reason = (
        "ReshardError: rank 2: the destination model must be a torch.nn.Module, a list of them (pipeline "
        "chunks) or None, not int"
    )
    for seconds, text in results:
        assert text == reason, text
        assert seconds < AT_ONCE, seconds  # carried in the round: nobody waits for the timeout


def test_a_lazy_parameter_is_named_on_every_rank_at_once():
    results = _run("lazy")
    reason = (
        "ReshardError: rank 2: the destination model's tensor w is uninitialized (a lazy module's "
        "parameter): run a forward (or initialize it) before refitting"
    )
    for seconds, text in results:
        assert text == reason, text
        assert seconds < AT_ONCE, seconds


def test_an_extractor_plugin_returning_garbage_is_named_by_its_plugin_name():
    results = _run("garbage_extractor")
    for rank in range(3):
        text = results[rank][1]
        assert (
            "the reshard_extract_tensor hook of plugin 'garbage-extractor' returned str for dst tensor 'w', "
            "not a list of TensorSpec"
        ) in text, text
    _healthy_in_time(results, 2)


def test_a_transform_whose_prepare_send_raises_is_named_by_its_receivers_at_once():
    results = _run("transform_raises")
    reason = "ValueError: the wire format cannot hold NaN here"
    assert reason in results[0][1]
    for rank in (1, 2):
        seconds, text = results[rank]
        where = f"TransportError: transport 'gloo' (plugin reshard-gloo): rank {rank}, batch 0: rank {rank}: "
        assert text.startswith(where), text
        assert f"recv from rank 0 (task {rank}, 64 bytes): rank 0 failed: {reason}" in text, text
        assert seconds < AT_ONCE, seconds
    _healthy_in_time(results, 0)


def test_a_rank_that_never_joins_is_named_within_the_timeout_plus_one_second():
    results = _run("stall_before")
    for rank in (1, 2):
        seconds, text = results[rank]
        assert "rank [0] of [0-2] did not join within 3 s" in text, text
        assert TIMEOUT <= seconds < TIMEOUT + SLACK, seconds


def test_a_rank_stalled_in_the_transport_is_named_within_the_timeout_plus_one_second():
    results = _run("stall_in_transport")
    for rank in (1, 2):
        seconds, text = results[rank]
        assert "recv from rank 0" in text and "timed out after 3 s" in text, text
        assert TIMEOUT <= seconds < TIMEOUT + SLACK, seconds


def _trainer(rank: int, world: int, port: int) -> tuple[float, str]:
    """Job 0 (2 ranks) holds the source; its rank 1 passes something that is no module."""
    import reshard_core
    from reshard_core import TransferGroup, declare_layout, refit  # noqa: F401 - imported before timing

    group = TransferGroup.join("127.0.0.1", port, rank=rank, size=4, job_ranks=range(0, 2), timeout=30)
    src = nn.Module()
    src.w = nn.Parameter(torch.arange(32.0).reshape(8, 4)[4 * rank : 4 * rank + 4].clone())
    declare_layout(src.w, dim=0, ranks=(0, 1))
    start = time.monotonic()
    try:
        reshard_core.refit(src if rank == 0 else "weights", None, group=group, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "no error"


def _engine(rank: int, world: int, port: int) -> tuple[float, str]:
    import reshard_core
    from reshard_core import TransferGroup, declare_layout, refit  # noqa: F401 - imported before timing

    group = TransferGroup.join("127.0.0.1", port, rank=2 + rank, size=4, job_ranks=range(2, 4), timeout=30)
    dst = nn.Module()
    dst.w = nn.Parameter(torch.zeros(8, 4))
    declare_layout(dst.w, ranks=(0, 1))  # replicated over the engine job's own ranks
    start = time.monotonic()
    try:
        reshard_core.refit(None, dst, group=group, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "no error"


def test_across_jobs_the_other_job_reads_the_failed_rank_and_its_reason():
    from reshard_core.testing.world import free_port, run_jobs

    port = free_port()
    trainer, engine = run_jobs((_trainer, 2, (port,)), (_engine, 2, (port,)), timeout=120, pg_timeout=60)
    reason = (
        "ReshardError: rank 1: the source model must be a torch.nn.Module, a list of them (pipeline "
        "chunks) or None, not str"
    )
    for seconds, text in [*trainer, *engine]:  # every rank of both jobs, the failed one too
        assert text == reason, text
        assert seconds < AT_ONCE, seconds


def _refused_then_late(rank: int, world: int) -> tuple[str, str]:
    """Every rank is refused alike (a plan error after the verdict); then rank 1 comes back 1 s
    after the others for a good refit. The refusal was no one rank's failure: nothing stands."""
    import reshard_core

    src, dst = models(rank)
    wrong = None
    if dst is not None:  # 5 columns where the source has 4
        wrong = nn.Module()
        wrong.w = nn.Parameter(torch.zeros(4, 5))
        reshard_core.declare_layout(wrong.w, dim=0, ranks=(1, 2))
    try:
        reshard_core.refit(src, wrong, timeout=TIMEOUT)
        refused = "no error"
    except Exception as exc:  # noqa: BLE001
        refused = type(exc).__name__
    if rank == 1:
        time.sleep(1.0)
    reshard_core.refit(src, dst, timeout=TIMEOUT)
    exact = dst is None or torch.equal(dst.w, torch.arange(32.0).reshape(8, 4)[4 * (rank - 1) : 4 * rank])
    return refused, "exact" if exact else "wrong"


def test_an_error_every_rank_raised_alike_does_not_stand_in_the_next_refit():
    results = run_world(_refused_then_late, 3, timeout=120, pg_timeout=60)
    assert results == [("PlanError", "exact")] * 3


def _fails_landing_once(rank: int, world: int) -> list[tuple[float, str]]:
    """Rank 1 fails on its own after its data arrived (landing it raises), so ranks 0 and 2 already
    wait in the closing round; then every rank tries twice more."""
    import reshard_core
    from reshard_core.execute import executor

    src, dst = models(rank)
    out = []
    for attempt in range(3):
        land = executor.land
        if rank == 1 and attempt == 0:

            def broken_land(ctx, message):
                raise RuntimeError("the destination's memory went away")

            executor.land = broken_land
        start = time.monotonic()
        try:
            reshard_core.refit(src, dst, timeout=TIMEOUT)
            text = "no error"
        except Exception as exc:  # noqa: BLE001 - the text is what the test checks
            text = f"{type(exc).__name__}: {exc}"
        finally:
            executor.land = land
        out.append((time.monotonic() - start, text))
    return out


def test_a_rank_failing_after_its_peers_finished_never_pairs_with_their_closing_round():
    """Rank 1 fails on its own while ranks 0 and 2 wait in the closing round, and calls ``refit``
    again at once. Its start round meets their closing round: before the rounds were stamped, the
    two all-reduces paired silently (ranks 0 and 2 reported success for the failed refit, and every
    later round was one call apart). Now every rank of that pairing raises that the ranks are out of
    step (or, when ranks 0 and 2 read rank 1's record first, its error), at once, and from then on
    every rank says the group is broken."""
    results = run_world(_fails_landing_once, 3, timeout=120, pg_timeout=60)
    reason = "RuntimeError: the destination's memory went away"
    out_of_step = (
        "the group's ranks are out of step (a rank whose previous refit failed on its own while its "
        "peers were closing it has started another one)"
    )
    assert results[1][0][1] == reason, results[1][0]
    for rank in (0, 2):
        seconds, text = results[rank][0]
        assert text in (
            f"TransportError: rank {rank}: refit could not finish: {out_of_step}",
            f"PeerFailed: rank {rank}: refit could not finish: rank 1 failed: {reason}",
        ), text
        assert seconds < AT_ONCE, seconds
    seconds, text = results[1][1]
    assert text == f"TransportError: rank 1: refit could not start: {out_of_step}", text
    assert seconds < AT_ONCE, seconds
    for rank, attempt in ((0, 1), (2, 1), (0, 2), (1, 2), (2, 2)):
        seconds, text = results[rank][attempt]
        assert text.startswith(f"BrokenGroup: rank {rank}: this refit group is broken: "), text
        assert seconds < 1.0, (rank, attempt, seconds)
