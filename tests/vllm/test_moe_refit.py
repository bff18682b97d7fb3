"""MoE: a real ``vllm serve`` of a tiny Qwen3-MoE at TP2 (every expert cut over both workers: vLLM
0.32's CPU worker crashes with expert parallelism, see ``test_vllm_gpu`` for that) refit by a
Megatron-Core MoE job in EP2 and by an FSDP2 transformers Qwen3-MoE job, each with three updates
checked against transformers on the same weights."""

from __future__ import annotations

import pytest
from vllm_jobs import SEEDS, check_rounds, hf_fsdp_job, megatron_job, served

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe", tp=2) as server:
        yield server


def test_a_megatron_moe_job_in_ep2_refits_tp_sharded_engine_experts(server) -> None:
    rounds = run_world(
        megatron_job, 2, server.url, server.model_dir, 0, "qwen3_moe", SEEDS, 1, 2, timeout=600
    )[0]
    check_rounds(rounds, "qwen3_moe")


def test_an_fsdp2_qwen3_moe_job_refits_tp_sharded_engine_experts(server) -> None:
    rounds = run_world(hf_fsdp_job, 2, server.url, server.model_dir, 0, "qwen3_moe", SEEDS, timeout=600)[0]
    check_rounds(rounds, "qwen3_moe")
