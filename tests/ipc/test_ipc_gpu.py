"""``ipc`` with CUDA tensors (needs CUDA): the conformance kit with two processes on one GPU (the
colocated case: a trainer rank and an engine worker per GPU) and, where two GPUs are present, on
two GPUs of one node; a colocated refit of a CUDA model, bit-exact, with CUDA IPC handles and with
CUDA tensors staged through the host ring (``RESHARD_IPC_CUDA=0``)."""

from __future__ import annotations

import os

import pytest
import torch
from reshard_ipc.transport import IpcCopyService

from reshard_core.testing.conformance import CHECK_NAMES, run_conformance
from reshard_core.testing.world import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def one_gpu() -> dict[str, str]:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return run_conformance(IpcCopyService, world_size=2, device="cuda", env={"CUDA_VISIBLE_DEVICES": first})


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_two_processes_on_one_gpu_conform(one_gpu, check):
    assert one_gpu[check] == "ok"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_two_gpus_of_one_node_conform(check):
    assert run_conformance(IpcCopyService, world_size=2, device="cuda")[check] == "ok"


def _colocated_refit(rank: int, world: int, cuda_ipc: str) -> bool:
    from torch import nn

    import reshard_core

    os.environ["RESHARD_IPC_CUDA"] = cuda_ipc
    torch.cuda.set_device(0)  # both ranks on one GPU: a colocated trainer rank and engine worker
    full = torch.arange(4096 * 1024, dtype=torch.float32, device="cuda").reshape(4096, 1024).bfloat16()
    src, dst = nn.Module(), nn.Module()
    src.w = nn.Parameter(full.chunk(2, dim=0)[rank].clone())
    dst.w = nn.Parameter(torch.zeros(4096, 512, dtype=torch.bfloat16, device="cuda"))
    reshard_core.declare_layout(src.w, dim=0, ranks=(0, 1))
    reshard_core.declare_layout(dst.w, dim=1, ranks=(0, 1))
    for _ in range(2):
        reshard_core.refit(src, dst, transport="ipc", timeout=60, verify=True)
    return torch.equal(dst.w.detach(), full.chunk(2, dim=1)[rank])


@pytest.mark.parametrize("cuda_ipc", ["1", "0"], ids=["cuda-ipc", "staged"])
def test_a_colocated_refit_on_one_gpu_is_exact(cuda_ipc):
    assert run_world(_colocated_refit, 2, cuda_ipc, timeout=300) == [True, True]
