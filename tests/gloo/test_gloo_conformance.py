"""The shared transport conformance suite, run against ``gloo`` on CPU (3 ranks, one spawned world)."""

from __future__ import annotations

import pytest
import torch
from reshard_gloo.transport import GlooCopyService

from reshard_core.testing.conformance import CHECK_NAMES, run_conformance

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    return run_conformance(GlooCopyService, world_size=3)


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_gloo_conformance(results: dict[str, str], check: str) -> None:
    assert results[check] == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gloo_conformance_cuda_tensors_staged_through_pinned_memory() -> None:
    results = run_conformance(GlooCopyService, world_size=2, device="cuda")
    assert results == {name: "ok" for name in CHECK_NAMES}
