"""``refit(..., version=)`` records a weight version on the destination once its update landed.

3-rank Gloo world: rank 0 holds the (8, 4) source, ranks 1 and 2 hold 4-row halves of the
destination. Each rank reports ``weight_version(dst)`` after: a refit with a version, a prepared
session's refit with the next one, a refit into two pipeline chunks, a good refit given no version,
and last (a failed refit leaves the group broken) a refit that failed in the data movement because
the sender's transform raised.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow


def _models(rank: int, chunks: int = 1):
    from reshard_core import declare_layout

    src, dst = None, None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(torch.arange(32.0).reshape(8, 4))
        declare_layout(src.w, ranks=(0,))
    else:
        dst = [nn.Module() for _ in range(chunks)]
        dst[0].w = nn.Parameter(torch.zeros(4, 4))
        declare_layout(dst[0].w, dim=0, ranks=(1, 2))
        dst = dst if chunks > 1 else dst[0]
    return src, dst


def _raising_transform():
    from reshard_core.transform import ReshardTransform

    class Raising(ReshardTransform):
        def should_transform(self, name: str) -> bool:
            return True

        def prepare_send(self, name, op, src_view):
            raise ValueError("no wire format today")

        def prepare_recv(self, name, op):
            return [torch.empty(op.numel)]

        def finalize_recv(self, name, op, buffers):
            pass

    return Raising()


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core import weight_version

    out = {}
    src, dst = _models(rank)
    out["before"] = weight_version(dst)
    reshard_core.refit(src, dst, version="step-1", timeout=10)
    out["refit"] = weight_version(dst)
    session = reshard_core.prepare(src, dst, timeout=10)
    session.refit(version="step-2")
    out["session"] = weight_version(dst)
    chunks_src, chunks = _models(rank, chunks=2)
    reshard_core.refit(chunks_src, chunks, version=7, timeout=10)
    out["chunks"] = weight_version(chunks)
    reshard_core.refit(src, dst, version="step-3", timeout=10)
    reshard_core.refit(src, dst, timeout=10)
    out["no_version"] = weight_version(dst)
    reshard_core.refit(src, dst, version="step-4", timeout=10)
    try:
        reshard_core.refit(src, dst, transform=_raising_transform(), version="step-5", timeout=10)
    except Exception as exc:  # noqa: BLE001 - every rank fails; the version is what is checked
        out["failed_with"] = type(exc).__name__
    out["failed"] = weight_version(dst)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(_world, 3, timeout=120, pg_timeout=60)


def test_a_version_is_recorded_on_the_destinations_once_the_update_landed(results):
    for rank in (1, 2):
        facts = results[rank]
        assert facts["before"] is None
        assert (facts["refit"], facts["session"]) == ("step-1", "step-2")
        assert facts["chunks"] == 7


def test_a_failed_update_leaves_no_version_and_an_unversioned_one_clears_it(results):
    for rank in (1, 2):
        facts = results[rank]
        assert facts["failed_with"] == "TransportError"  # the receivers learn the sender's error
        assert facts["failed"] is None
        assert facts["no_version"] is None
    assert results[0]["failed_with"] == "ValueError"  # the sender's own transform
    assert results[0]["refit"] is None  # a rank without destinations holds no version
