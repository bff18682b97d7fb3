"""A real ``vllm serve`` process at TP1 (one worker, vLLM rank 0 = transfer group rank 2) refit by a
separate 2-rank FSDP2 trainer job: three updates, each checked against transformers; the worker
receives exactly its parameters' bytes, half from each trainer rank."""

from __future__ import annotations

import pytest
from vllm_jobs import DTYPE, SEEDS, check_rounds, hf_fsdp_job

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

T = pytest.importorskip("reshard_vllm.testing")


def test_an_fsdp2_llama_job_refits_a_tp1_server(tmp_path) -> None:
    model_dir = T.write_model_dir(tmp_path, T.tiny_llama_config(dtype=DTYPE))
    with T.VLLMServer(
        model_dir, tp=1, weight_transfer_backend="reshard", startup_timeout=600, dtype=DTYPE
    ) as server:
        print(f"TP1 server started in {server.startup_seconds:.1f} s")
        rounds = run_world(hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, timeout=600)[0]
    check_rounds(rounds, workers=(2,))
