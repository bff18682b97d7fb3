"""Errors from inside a transport reach every caller as one ``TransportError`` naming the transport and
the plugin providing it (prefixed once, at the executor boundary), and a transport that failed is
closed and never reused by a later refit. One 2-rank Gloo world: rank 0 holds the source, rank 1 the
destination."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.errors import TransportError
from reshard_core.testing.world import run_world
from reshard_core.transport.copy_service import CopyService

pytestmark = pytest.mark.slow

SOURCE = torch.arange(32.0).reshape(8, 4)


class Exploding(CopyService):
    """An in-process transport (no plugin) whose ``run()`` fails like a broken backend would."""

    name = "exploding"

    def submit_send(self, tensor, dest_rank, task_id):
        pass

    def submit_recv(self, tensor, src_rank, task_id):
        pass

    def run(self):
        raise RuntimeError("the wire is on fire")


def _world(rank: int, world: int) -> dict:
    import reshard_gloo.transport as gloo

    import reshard_core
    from reshard_core import declare_layout
    from reshard_core import session_cache as api

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(SOURCE.clone())
        declare_layout(src.w, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w = nn.Parameter(torch.zeros(8, 4))
        declare_layout(dst.w, ranks=(1,))
    out: dict = {}
    reshard_core.refit(src, dst, timeout=10)
    (first,) = api._transports.values()

    def broken(ops):
        raise RuntimeError("injected failure")

    original, gloo._stage_to_host = gloo._stage_to_host, broken  # Gloo fails on both ranks at once
    try:
        reshard_core.refit(src, dst, timeout=10)
    except TransportError as exc:
        out["failed"] = str(exc)
    gloo._stage_to_host = original
    out["closed"] = first._closed
    out["cached after failure"] = (len(api._transports), len(api._sessions))

    if dst is not None:
        dst.w.data.zero_()
    report = reshard_core.refit(src, dst, timeout=10)
    (again,) = api._transports.values()
    out["fresh"] = again is not first
    out["rebuilt"] = not report.reused_plan
    out["exact"] = dst is None or torch.equal(dst.w, SOURCE)

    try:
        reshard_core.refit(src, dst, transport=Exploding(), timeout=10)
    except TransportError as exc:
        out["fake"] = str(exc)
    reshard_core.clear_caches()
    return out


def test_a_failed_transport_is_closed_forgotten_and_named_with_its_plugin():
    results = run_world(_world, 2, timeout=120, pg_timeout=60)
    for rank in (0, 1):
        got = results[rank]
        op = "send to rank 1" if rank == 0 else "recv from rank 0"
        assert got["failed"] == (
            f"transport 'gloo' (plugin reshard-gloo): rank {rank}, batch 0: gloo: could not start {op} "
            "(task 1, 128 bytes): injected failure"
        )
        assert got["closed"] is True
        assert got["cached after failure"] == (0, 0)
        assert got["fresh"] and got["rebuilt"] and got["exact"]
        assert got["fake"] == (
            f"transport 'exploding' (not a plugin: {Exploding.__module__}.Exploding): "
            "RuntimeError: the wire is on fire"
        )
