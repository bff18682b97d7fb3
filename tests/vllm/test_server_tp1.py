"""A real ``vllm serve`` process at TP1 (one worker, vLLM rank 0 = transfer group rank 2) refit by a
separate 2-rank FSDP2 trainer job, over ``gloo`` and over ``ipc``: three updates, each checked
against transformers; the worker receives exactly its parameters' bytes, half from each trainer rank.
``test_server_faults.py`` runs its malformed-init and killed-trainer cases against the same server."""

from __future__ import annotations

import pytest
from vllm_jobs import SEEDS, check_rounds, hf_fsdp_job

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_an_fsdp2_llama_job_refits_a_tp1_server(llama_tp1_server, transport) -> None:
    server = llama_tp1_server
    rounds = run_world(
        hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, transport, timeout=600
    )[0]
    check_rounds(rounds, workers=(2,))
