"""The ``nvshmem`` transport on GPUs: the shared conformance suite, and a refit against ``nccl``.

Needs CUDA, nvshmem4py and two GPUs (one NVSHMEM PE per GPU); skipped otherwise.
"""

from __future__ import annotations

import time

import pytest
import torch
from reshard_nvshmem.transport import NvshmemCopyService


def _skip_reason() -> str | None:
    reason = NvshmemCopyService.unavailable_reason()
    if reason is None and torch.cuda.device_count() < 2:
        reason = "needs 2 GPUs (one NVSHMEM PE per GPU)"
    return reason


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(_skip_reason() is not None, reason=f"nvshmem: {_skip_reason()}"),
]

CHECKS = ("dtypes", "order", "shapes", "empty_run", "bad_input", "close", "timeout")


@pytest.fixture(scope="module")
def conformance() -> dict[str, str]:
    from reshard_core.testing.conformance import run_conformance

    # Small slots so the order check's 1 MiB messages are cut into pieces and slots get reused.
    return run_conformance(NvshmemCopyService, world_size=2, device="cuda", options={"slot_bytes": 1 << 18})


@pytest.mark.parametrize("check", CHECKS)
def test_conformance(conformance: dict[str, str], check: str) -> None:
    assert conformance[check] == "ok"


def test_every_conformance_check_passes(conformance: dict[str, str]) -> None:
    assert {name: why for name, why in conformance.items() if why != "ok"} == {}


def _refit_both(rank: int, world: int, size: int, count: int) -> dict:
    """Refit dim-0 shards into dim-1 shards with ``nccl`` then ``nvshmem``; same plan, same data."""
    from reshard_nccl.transport import NcclCopyService
    from torch import nn

    from reshard_core import clear_caches, declare_layout, refit

    torch.cuda.set_device(rank)
    src, dst, expected = nn.Module(), nn.Module(), []
    for i in range(count):
        full = (torch.arange(size * size, device="cuda", dtype=torch.int32) % 251 + i).view(size, size)
        full = full.to(torch.bfloat16)
        src.register_buffer(f"w{i}", declare_layout(full.chunk(world, 0)[rank].clone(), dim=0))
        dst.register_buffer(f"w{i}", declare_layout(torch.zeros_like(full.chunk(world, 1)[rank]), dim=1))
        expected.append(full.chunk(world, 1)[rank].cpu())
    out: dict = {}
    for name, cls in (("nccl", NcclCopyService), ("nvshmem", NvshmemCopyService)):
        service = cls(None, timeout=120)
        for buf in dst.buffers():
            buf.zero_()
        refit(src, dst, transport=service)  # cold: plan, session, first schedules
        seconds = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            report = refit(src, dst, transport=service)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        out[name] = {
            "values": [b.cpu() for b in dst.buffers()],
            "bytes": report.bytes_sent + report.bytes_received,
            "seconds": min(seconds),
        }
        service.close()
    clear_caches()
    out["exact"] = all(torch.equal(a, b) for a, b in zip(out["nvshmem"]["values"], expected, strict=True))
    out["same"] = all(
        torch.equal(a, b) for a, b in zip(out["nvshmem"]["values"], out["nccl"]["values"], strict=True)
    )
    for name in ("nccl", "nvshmem"):
        del out[name]["values"]
    return out


def test_refit_matches_nccl_and_reports_bandwidth() -> None:
    from reshard_core.testing.world import run_world

    results = run_world(_refit_both, 2, 8192, 4, timeout=600)
    for rank, res in enumerate(results):
        for name in ("nccl", "nvshmem"):
            nbytes, seconds = res[name]["bytes"], res[name]["seconds"]
            rate = nbytes / seconds / 1e9
            print(f"rank {rank} {name}: {nbytes / 2**20:.0f} MiB in {seconds:.4f} s, {rate:.1f} GB/s")
        assert res["exact"] and res["same"]
