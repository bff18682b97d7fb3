"""The offline ``vllm.LLM`` (tiny Llama, TP1) refit by a trainer in this very process.

The trainer has no ``torch.distributed`` world: it is rank 0 of a 1-rank trainer job, joined with
the engine's worker into a transfer group, and drives the engine through ``reshard_vllm.LLMClient``.
Three updates with new weights; after each, the engine's greedy output agrees with transformers on
the same weights and differs from the previous round's, the recorded weight version is the update's,
and the worker received exactly its parameters' bytes.
"""

from __future__ import annotations

import re

import pytest
import vllm_harness as T
from vllm_jobs import DTYPE, LOGPROB_ATOL, NEW_TOKENS, PROMPT, model_for

from reshard_core.testing.world import free_port

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = T.write_model_dir(tmp_path_factory.mktemp("llama"), T.tiny_llama_config(dtype=DTYPE))
    engine = T.offline_llm(model_dir, tp=1, dtype=DTYPE, weight_transfer_config={"backend": "reshard"})
    yield engine
    T.shutdown_llm(engine)


def test_three_updates_of_the_offline_llm_each_match_transformers(llm) -> None:
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    config = T.tiny_llama_config(dtype=DTYPE)
    model = model_for(config, 0)
    info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=60)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=LLMClient(llm), source=ModuleSource(model)
    )
    previous = T.llm_greedy(llm, PROMPT, NEW_TOKENS)[0]
    for seed in (31, 32, 33):
        model.load_state_dict(model_for(config, seed).state_dict())
        verdict = engine.send_weights(version=f"step-{seed}")
        tokens, logprobs = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
        check = T.check_greedy(
            model, PROMPT, tokens, logprobs, logprob_atol=LOGPROB_ATOL, tie_atol=LOGPROB_ATOL
        )
        assert check.ok, f"seed {seed}: {check}"
        assert tokens != previous
        previous = tokens
        assert llm.get_weight_version() == f"step-{seed}"
        [(got, expected)] = verdict.received.values()
        assert got == expected == sum(p.numel() * p.element_size() for p in model.parameters())
    engine.shutdown()


def test_a_failed_update_keeps_the_previous_weights_and_version(llm) -> None:
    """A trainer whose model the engine cannot hold: both sides raise, the old weights keep serving."""
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard_core.errors import ReshardError

    before, version = T.llm_greedy(llm, PROMPT, NEW_TOKENS), llm.get_weight_version()
    wrong = model_for(T.tiny_llama_config(vocab_size=640, dtype=DTYPE), 5)
    info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=20)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=wrong)
    with pytest.raises(ReshardError) as error:
        engine.send_weights(version="never")
    text = str(error.value)
    assert re.match(r"weight update failed, previous weights kept on every worker: ranks? 0[:,]", text), text
    assert "lm_head.weight" in text and "(640, 128)" in text, text
    assert T.llm_greedy(llm, PROMPT, NEW_TOKENS) == before
    assert llm.get_weight_version() == version
    engine.shutdown()


def _buffers(llm) -> dict:
    """The worker's checkpoint-layout receive buffers (what a refit writes), copied out."""
    [buffers] = llm.collective_rpc(
        lambda self: {k: v.clone() for k, v in self.weight_transfer_engine.buffers.items()}
    )
    return buffers


def test_delta_updates_move_only_what_changed_and_land_exactly(llm) -> None:
    """Five updates with ``delta=True``: the first whole, then 1 % of the trainer's elements change
    per update (one whole update between, as after a learning-rate spike). Each matches
    transformers; the deltas move a small share of the bytes; afterwards the worker's buffers equal,
    bit for bit, those a plain update of the same weights writes."""
    import torch
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    config = T.tiny_llama_config(dtype=DTYPE)
    model = model_for(config, 40)
    info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=60)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=LLMClient(llm), source=ModuleSource(model)
    )
    gen = torch.Generator().manual_seed(0)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    moved = []
    for update in range(5):
        if update:
            with torch.no_grad():
                for p in model.parameters():
                    share = 0.5 if update == 2 else 0.01
                    mask = torch.rand(p.shape, generator=gen) < share
                    p.add_(mask * torch.randn(p.shape, generator=gen) * 0.002)
        verdict = engine.send_weights(version=f"delta-{update}", delta=True)
        tokens, logprobs = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
        check = T.check_greedy(
            model, PROMPT, tokens, logprobs, logprob_atol=LOGPROB_ATOL, tie_atol=LOGPROB_ATOL
        )
        assert check.ok, f"update {update}: {check}"
        [(got, expected)] = verdict.received.values()
        assert expected == full
        moved.append((got, engine.report.delta.messages, engine.report.delta.note))
    assert moved[0][0] == full and moved[0][1] == 0 and "first delta refit" in moved[0][2], moved
    for got, deltas, _ in (moved[1], moved[3], moved[4]):
        assert deltas > 0 and got < full / 10, moved
    assert moved[2][0] > full / 2, moved  # half the elements changed: whole messages
    after_deltas = _buffers(llm)
    engine.send_weights(version="plain")
    after_plain = _buffers(llm)
    assert after_deltas.keys() == after_plain.keys()
    assert [k for k in after_plain if not torch.equal(after_deltas[k], after_plain[k])] == []
    assert llm.get_weight_version() == "plain"
    engine.shutdown()


def test_a_tensor_the_engine_lacks_is_named_and_ignore_through_send_weights_leaves_it_out(llm) -> None:
    """The trainer's model has a tensor no engine parameter holds: the update is refused naming it
    and suggesting ``ignore=``, which ``send_weights`` takes; with it the update lands exactly."""
    import torch
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from reshard_core.errors import ReshardError

    config = T.tiny_llama_config(dtype=DTYPE)
    model = model_for(config, 51)
    model.model.register_parameter("value_head", torch.nn.Parameter(torch.ones(4)))  # an RL critic's
    info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=60)
    client = LLMClient(llm)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    before = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
    with pytest.raises(ReshardError) as error:
        engine.send_weights(version="with-critic")
    assert str(error.value) == (
        "weight update failed, previous weights kept on every worker: ranks 0, 1: PlanError: "
        "model.value_head: on the source only (ranks [0]), no destination holds it; "
        "pass ignore=['model.value_head'] to leave it out"
    )
    assert T.llm_greedy(llm, PROMPT, NEW_TOKENS) == before
    engine.send_weights(version="without-critic", ignore=["model.value_head"])
    tokens, logprobs = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
    check = T.check_greedy(model, PROMPT, tokens, logprobs, logprob_atol=LOGPROB_ATOL, tie_atol=LOGPROB_ATOL)
    assert check.ok, str(check)
    assert llm.get_weight_version() == "without-critic"
    with pytest.raises(ReshardError) as error:
        engine.send_weights(ignore="x")
    assert str(error.value) == "reshard: ignore must be a list of tensor names or patterns, got 'x'"
    engine.shutdown()
