"""A real ``vllm serve`` process (tiny Llama, TP2) refit by separate 2-rank trainer jobs through
vLLM's HTTP weight-sync client and backend "reshard".

One server serves every test of this module and of ``test_server_faults.py`` (conftest). After each
update, the engine's greedy tokens and logprobs must agree with transformers on the same full weights
(teacher-forced, float32, logprobs within 1e-3) and differ from the previous round's; every worker
receives exactly the bytes of its own parameters. Bad updates fail on both sides and leave the
previous weights serving, which is checked by generation.
"""

from __future__ import annotations

import pytest
import torch
import vllm_harness as T
from vllm_jobs import (
    DTYPE,
    LOGPROB_ATOL,
    NEW_TOKENS,
    PROMPT,
    SEEDS,
    cast_job,
    check_rounds,
    failing_job,
    hf_fsdp_job,
    megatron_job,
    model_for,
)

from reshard_core.testing.world import WorldError, free_port, run_world

pytestmark = pytest.mark.slow


@pytest.fixture
def server(llama_tp2_server):
    return llama_tp2_server


def test_an_fsdp2_llama_job_refits_the_tp2_server(server) -> None:
    rounds = run_world(hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, timeout=600)[0]
    check_rounds(rounds)


def test_an_fsdp2_llama_job_refits_the_tp2_server_over_ipc(server) -> None:
    """The trainer job and the engine share this host: every pair goes through shared memory."""
    rounds = run_world(hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, "ipc", timeout=600)[0]
    check_rounds(rounds)


def test_a_megatron_tp2_job_refits_the_tp2_server_over_ipc_and_with_deltas_over_ipc(server) -> None:
    rounds = run_world(
        megatron_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, 2, 1, "ipc", timeout=600
    )[0]
    check_rounds(rounds)
    rounds = run_world(
        hf_fsdp_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, "ipc", True, timeout=600
    )[0]
    check_rounds(rounds, exact_bytes=False)


def test_a_megatron_tp2_job_refits_the_tp2_server(server) -> None:
    rounds = run_world(megatron_job, 2, server.url, server.model_dir, 0, "llama", SEEDS, 2, 1, timeout=600)[0]
    check_rounds(rounds)


def _serving(server) -> list[int]:
    return server.completions(PROMPT, NEW_TOKENS)[0]


def test_a_model_that_does_not_match_the_engine_fails_both_sides_and_keeps_the_old_weights(server) -> None:
    before = _serving(server)
    [text, _] = run_world(failing_job, 2, server.url, server.model_dir, 0, "mismatch", timeout=300)
    assert text.startswith("ReshardError: weight update failed, previous weights kept on every worker: "), (
        text
    )
    assert "model.layers.2." in text, text  # the trainer's extra layer is named
    assert _serving(server) == before


def test_a_trainer_rank_that_dies_mid_update_leaves_the_old_weights(server, tmp_path) -> None:
    before = _serving(server)
    out = tmp_path / "rank0.txt"
    with pytest.raises(WorldError, match=r"ranks 1 \(exit code 3\) died without reporting"):
        run_world(failing_job, 2, server.url, server.model_dir, 0, "dies", str(out), timeout=300)
    text = out.read_text()  # rank 0 waited for rank 1 in vain, before the engine was touched
    assert text == (
        "TransportError: transfer group rank 0: vLLM start of the update: ranks [1] did not report "
        "within 10 s (failed, exited or stalled)"
    ), text
    assert _serving(server) == before


def test_a_wrong_port_fails_the_trainer_and_the_engine_keeps_serving(server) -> None:
    """The engine is told a port nobody hosts... by a trainer whose store is elsewhere: both sides
    fail within the timeout, and the engine still serves its weights."""
    before = _serving(server)
    with pytest.raises(Exception) as info:
        server.post("/init_weight_transfer_engine", {
            "init_info": {"master_address": "127.0.0.1", "master_port": free_port(),
                          "trainer_world_size": 1, "timeout": 3}
        }, timeout=120)  # fmt: skip
    assert "could not reach the rendezvous store at 127.0.0.1:" in str(info.value), str(info.value)
    assert _serving(server) == before


def test_a_bf16_trainer_needs_cast_for_the_float32_engine_and_then_lands(server) -> None:
    [(outcomes, answers), (others, _)] = run_world(cast_job, 2, server.url, server.model_dir, 71, timeout=600)
    refused, landed = outcomes
    assert others == outcomes
    assert refused.startswith("ReshardError: weight update failed"), refused
    assert "differ only in dtype" in refused and "cast=True" in refused, refused
    assert answers[1] == answers[0]  # refused: the previous weights still serve
    assert landed == "ok"
    tokens, logprobs = answers[2]
    reference = model_for(T.tiny_llama_config(dtype=DTYPE), 71).to(torch.bfloat16).float()  # what was sent
    check = T.check_greedy(
        reference, PROMPT, tokens, logprobs, logprob_atol=LOGPROB_ATOL, tie_atol=LOGPROB_ATOL
    )
    assert check.ok, str(check)
