"""The vLLM stand-in against real vLLM: the same parameter names and per-rank shapes.

Needs CUDA and an installed vllm (a CUDA torch): skipped elsewhere. A tiny model is built in-process
from a saved config with dummy weights (no download), each worker reports its parameters, and format
"vllm" maps the real model with the parallel description it reads from vLLM's groups.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _configs():
    from transformers import LlamaConfig, Qwen3MoeConfig

    llama = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    moe = Qwen3MoeConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=6,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=256, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    return {"llama": llama, "qwen3_moe": moe}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_standin_names_and_shapes_equal_vllms_per_rank(tmp_path, monkeypatch, family, tp):
    vllm = pytest.importorskip("vllm")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from reshard_core.formats.vllm import VLLMParallel
    from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM

    config = _configs()[family]
    config.save_pretrained(tmp_path)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    ep = family == "qwen3_moe" and tp > 1
    llm = vllm.LLM(
        model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
        enable_expert_parallel=ep, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=128,
        dtype="bfloat16",
    )  # fmt: skip

    def probe(worker):
        from reshard_core.extract import ExtractContext
        from reshard_core.formats.vllm import VLLMFormat, parallel_from_vllm

        model = worker.model_runner.model
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        mapped = VLLMFormat().logical_specs(model, "dst", ExtractContext.create())
        parallel = parallel_from_vllm(model)
        return shapes, parallel.tp_groups, parallel.use_ep, mapped.unmapped, len(mapped.specs)

    reports = llm.collective_rpc(probe)
    assert len(reports) == tp
    parallel = VLLMParallel.of(range(tp), enable_expert_parallel=ep)
    for rank, (shapes, groups, use_ep, unmapped, count) in enumerate(reports):
        standin = VLLMStandInForCausalLM(config, parallel, rank)
        assert shapes == {n: tuple(p.shape) for n, p in standin.named_parameters()}
        assert (groups, use_ep, unmapped) == (parallel.tp_groups, ep, [])
        assert count > 0
