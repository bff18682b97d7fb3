"""The shared conformance suite against ``nccl`` (needs two CUDA GPUs: NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import pytest
import torch
from reshard_nccl.transport import NcclCopyService

from reshard_core.testing.conformance import CHECK_NAMES, run_conformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_conformance(NcclCopyService, world_size=2, device="cuda")


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_nccl_conformance(results: dict[str, str], check: str) -> None:
    assert results[check] == "ok"
