"""Every family refits a real ``vllm serve`` at TP2 from a separate FSDP2 trainer job, and a failed
update leaves the engine serving exactly its previous weights.

One server per family (tiny config, float32 but for Qwen3-Next's bfloat16, dummy weights, the test's
fault-injection worker extension), one trainer job of two ranks, four updates:

1. seed 11: greedy generation matches transformers on the same weights; every worker received
   exactly the bytes of its parameters;
2. seed 12, with worker 1's receive made to fail: every trainer rank raises the same error, and the
   engine answers exactly as after update 1 (same tokens, same logprobs);
3. seed 12, with worker 1 failing to open the staged update in ``finish``: likewise;
4. seed 12: generation matches transformers on seed 12's weights (a second update with other weights:
   anything vLLM derives from the weights, MLA's absorbed matrices or repacked experts, left stale
   shows here).

DeepSeek-V3's server is then refit by a Megatron-Core job (TP2·EP2, MLA, four ranks) twice, each
update matching transformers on the weights the Megatron model holds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import tiny
from family_jobs import NEW_TOKENS, PROMPT, fsdp_rounds, megatron_rounds
from vllm_harness import VLLMServer, check_greedy, write_model_dir

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

VLLM_TESTS = str(Path(__file__).parent.parent / "vllm")
ROUNDS = [(11, ""), (12, "update"), (12, "finish"), (12, "")]


def _check(kind: str, seed: int, tokens: list[int], logprobs: list[float]) -> None:
    atol = tiny.LOGPROB_ATOL.get(kind, 1e-3)
    reference = tiny.reference(kind, seed)
    check = check_greedy(reference, PROMPT, tokens, logprobs, logprob_atol=atol, tie_atol=atol)
    assert check.ok, f"seed {seed}: {check}"


@pytest.fixture(scope="module", params=tiny.KINDS)
def server(request, tmp_path_factory):
    kind = request.param
    tmp_path = tmp_path_factory.mktemp(kind)
    extra = ["--worker-extension-cls", "fault_injection.FaultInjection", *tiny.SERVER_ARGS.get(kind, [])]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (VLLM_TESTS, os.environ.get("PYTHONPATH")) if p)}
    model_dir = write_model_dir(tmp_path / kind, tiny.config(kind))
    options = dict(dtype=tiny.dtype_name(kind), env=env, extra_args=extra, log_path=tmp_path / "server.log")
    with VLLMServer(model_dir, tp=2, weight_transfer_backend="reshard", startup_timeout=600, **options) as up:
        yield kind, up


def test_an_fsdp2_job_refits_the_tp2_server_and_failed_updates_keep_its_weights(server) -> None:
    kind, running = server
    rounds = run_world(fsdp_rounds, 2, running.url, running.model_dir, kind, ROUNDS, timeout=600)[0]
    (first, tokens, logprobs, received), failed_receive, failed_finish, last = rounds

    assert first == "ok"
    _check(kind, 11, tokens, logprobs)
    assert len(tokens) == NEW_TOKENS and sorted(received) == [2, 3]
    assert all(got == expected > 0 for got, expected in received.values()), received

    assert failed_receive[0] == (
        "ReshardError: weight update failed, previous weights kept on every worker: ranks 0, 1, 2, 3: "
        "ReshardError: rank 3: RuntimeError: injected fault: update on worker 1"
    )
    assert failed_finish[0].startswith("ReshardError: reshard: the engine's finish_weight_update failed: ")
    assert "worker 1 could not open its update: injected fault: finish on worker 1" in failed_finish[0]
    for failed in (failed_receive, failed_finish):
        assert failed[1:3] == (tokens, logprobs)  # exactly what update 1 served

    assert last[0] == "ok"
    _check(kind, 12, last[1], last[2])
    assert last[1] != tokens


@pytest.mark.parametrize("server", ["deepseek_v3"], indirect=True)
def test_a_megatron_tp2_ep2_job_refits_the_deepseek_v3_server(server) -> None:
    kind, running = server
    rounds = run_world(megatron_rounds, 4, running.url, running.model_dir, kind, [31, 32], timeout=600)[0]
    previous = None
    for seed, (tokens, logprobs, received) in zip([31, 32], rounds, strict=True):
        _check(kind, seed, tokens, logprobs)
        assert tokens != previous and sorted(received) == [4, 5]
        assert all(got == expected > 0 for got, expected in received.values()), received
        previous = tokens


def _init_outcome(rank: int, world: int, url: str) -> str:
    from family_jobs import trainer

    from reshard_core.testing.world import outcome

    return outcome(lambda: trainer(rank, world, url, tiny.hf_model(tiny.unmapped_config(), 3), timeout=20))


def test_a_model_type_no_family_maps_is_refused_at_trainer_init_on_every_rank(tmp_path) -> None:
    """A Phi-3 engine: every trainer rank's ``trainer_init`` raises naming the type, before any update,
    and the engine serves as before."""
    model_dir = write_model_dir(tmp_path / "phi3", tiny.unmapped_config())
    with VLLMServer(model_dir, tp=2, weight_transfer_backend="reshard", dtype="float32", startup_timeout=600,
                    log_path=tmp_path / "server.log") as running:  # fmt: skip
        before = running.completions(PROMPT, NEW_TOKENS)
        outcomes = run_world(_init_outcome, 2, running.url, timeout=300)
        assert running.completions(PROMPT, NEW_TOKENS) == before
    why = (
        "reshard: this engine cannot be refit: format 'vllm' knows model types deepseek_v3, glm4_moe, "
        "gpt_oss, kimi_k2, llama, mistral, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next, not 'phi3'"
    )
    for rank, text in enumerate(outcomes):  # each rank names itself and the group's address
        assert re.fullmatch(
            rf"ReshardError: reshard: trainer_init failed: transfer group rank {rank} at 127\.0\.0\.1:\d+: "
            + re.escape(why),
            text,
        ), text
