"""GPU only (skipped without CUDA): the offline ``LLM`` on a GPU refit over NCCL, written in place.

On a GPU, vLLM keeps unquantized bf16 weights in their checkpoint layout, so backend "reshard"
writes them in place (``reload.InPlaceUpdate``: receive buffers, then one copy into the storage
CUDA graphs captured) instead of through vLLM's layerwise reload; both paths are checked against
transformers, the in-place one over the ``nccl`` transport. Expert parallelism on the engine (which
crashes vLLM 0.32's CPU worker) is refit here too.
"""

from __future__ import annotations

import pytest
import vllm_harness as T
from vllm_jobs import NEW_TOKENS, PROMPT, model_for

from reshard_core.testing.world import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow]



def _refit_three_times(llm, config, *, transport: str, inplace: bool | None) -> None:
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    model = model_for(config, 0).cuda()
    info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, transport=transport)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=model)
    llm.collective_rpc(lambda self: setattr(self.weight_transfer_engine.info, "inplace", inplace))
    for seed in (41, 42, 43):
        model.load_state_dict(model_for(config, seed).state_dict())
        engine.send_weights()
        tokens, logprobs = T.llm_greedy(llm, PROMPT, NEW_TOKENS)
        check = T.check_greedy(model, PROMPT, tokens, logprobs)
        assert check.ok, f"seed {seed}: {check}"
    engine.shutdown()


@pytest.mark.parametrize(
    ("transport", "inplace"), [("nccl", True), ("gloo", False)], ids=["nccl-inplace", "gloo-reload"]
)
def test_a_gpu_engine_is_refit_in_place_over_nccl_and_through_the_reload(
    tmp_path, transport, inplace
) -> None:
    config = T.tiny_llama_config()
    llm = T.offline_llm(
        T.write_model_dir(tmp_path, config), tp=1, weight_transfer_config={"backend": "reshard"}
    )
    try:
        _refit_three_times(llm, config, transport=transport, inplace=inplace)
    finally:
        T.shutdown_llm(llm)


def test_engine_expert_parallelism_on_gpu(tmp_path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("expert parallelism over 2 workers needs 2 GPUs")
    config = T.tiny_qwen3_moe_config()
    llm = T.offline_llm(
        T.write_model_dir(tmp_path, config), tp=2, enable_expert_parallel=True,
        weight_transfer_config={"backend": "reshard"},
    )  # fmt: skip
    try:
        _refit_three_times(llm, config, transport="nccl", inplace=None)
    finally:
        T.shutdown_llm(llm)
