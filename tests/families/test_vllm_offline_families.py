"""Every family refits the offline ``vllm.LLM`` at TP1 from a trainer in this very process.

The trainer is rank 0 of a one-rank job (no ``torch.distributed`` world), joined with the engine's
one worker and driving it through ``reshard_vllm.LLMClient``. Two updates with different weights;
after each, greedy generation agrees with transformers on the same weights, the engine records the
update's version, and the worker received exactly the bytes of its parameters.
"""

from __future__ import annotations

import pytest
import tiny
import vllm_harness as T
from family_jobs import NEW_TOKENS, PROMPT

from reshard_core.testing.world import free_port

pytestmark = pytest.mark.slow



@pytest.mark.parametrize("kind", tiny.KINDS)
def test_two_updates_of_the_offline_llm_each_match_transformers(tmp_path, kind) -> None:
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    model_dir = T.write_model_dir(tmp_path / kind, tiny.config(kind), tokenizer=False)
    backend = {"backend": "reshard"}
    llm = T.offline_llm(model_dir, tp=1, dtype=tiny.dtype_name(kind), weight_transfer_config=backend,
                        **tiny.LLM_ARGS.get(kind, {}))  # fmt: skip
    try:
        model = tiny.hf_model(kind, 21)
        info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=60)
        client = LLMClient(llm)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        previous = None
        atol = tiny.LOGPROB_ATOL.get(kind, 1e-3)
        for seed in (21, 22):
            model.load_state_dict(tiny.hf_model(kind, seed).state_dict())
            verdict = engine.send_weights(version=f"{kind}-{seed}", **tiny.SEND_OPTIONS.get(kind, {}))
            tokens, logprobs = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
            check = T.check_greedy(tiny.reference(kind, seed), PROMPT, tokens, logprobs, logprob_atol=atol,
                                   tie_atol=atol)  # fmt: skip
            assert check.ok, f"seed {seed}: {check}"
            assert tokens != previous
            previous = tokens
            assert llm.get_weight_version() == f"{kind}-{seed}"
            [(got, expected)] = verdict.received.values()
            assert got == expected > 0
        engine.shutdown()
    finally:
        T.shutdown_llm(llm)
