"""The vLLM stand-in against real vLLM: what format "vllm" makes of each, rank by rank, is the same.

Needs CUDA and an installed vllm (a CUDA torch): skipped elsewhere. A tiny model is built in-process
from a saved config with dummy weights (no download), each worker reports its parameters, and format
"vllm" maps the real model with the parallel description it reads from vLLM's groups. Names are
compared through the format's own name handling, not literally: vLLM up to 0.31 registers a MoE
layer's experts as ``mlp.experts.w13_weight``, newer vLLM (0.32: ``MoERunner.routed_experts``) as
``mlp.experts.routed_experts.w13_weight``, and the stand-in keeps the older names.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn


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


def _make_probe():
    """``probe(worker, context=None)``: format "vllm"'s view of ``worker.model_runner.model`` on one rank.

    The view holds each logical tensor's global shape, layout and local shape, the padding's local
    shapes, the parameters the format cannot map, the parallel description it read (None for a
    model that declares its own) and the model's local parameter shapes as a sorted list (names aside).
    Built by a factory so that vLLM ships it to its workers by value (a nested function).
    """

    def probe(worker: Any, context: Any = None) -> dict[str, Any]:
        from reshard_vllm.layout import parallel_from_vllm

        from reshard_core.extract import ExtractContext
        from reshard_core.formats.vllm import PARALLEL_ATTR, VLLMFormat

        model = worker.model_runner.model
        mapped = VLLMFormat().logical_specs(model, "dst", context or ExtractContext.create())
        read = None if hasattr(model, PARALLEL_ATTR) else parallel_from_vllm(model)
        specs = {s.meta.name: (tuple(s.meta.shape), s.layout, tuple(s.tensor.shape)) for s in mapped.specs}
        return {
            "specs": specs,
            "padding": [tuple(t.shape) for t in mapped.padding],
            "unmapped": mapped.unmapped,
            "parallel": None if read is None else (read.tp_groups, read.use_ep),
            "shapes": sorted(tuple(p.shape) for p in model.parameters()),
        }

    return probe


def _standin_view(config: Any, parallel: Any, rank: int, *, routed: bool = False) -> dict[str, Any]:
    """``_make_probe()``'s view of the stand-in for ``rank``; ``routed``: experts renamed as vLLM 0.32."""
    from reshard_core.extract import ExtractContext
    from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM

    model = VLLMStandInForCausalLM(config, parallel, rank)
    for layer in model.model.layers if routed else ():
        if hasattr(layer.mlp, "experts"):
            runner = nn.Module()  # vLLM 0.32's MoERunner holds the weights in its routed_experts
            runner.routed_experts = layer.mlp.experts
            layer.mlp.experts = runner
    context = ExtractContext(rank=rank, world=len(parallel.ranks))
    return _make_probe()(SimpleNamespace(model_runner=SimpleNamespace(model=model)), context)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_both_vllm_expert_namings_give_the_same_view(ep):
    """CPU check of the comparison the GPU test makes: the routed_experts naming changes no view."""
    from reshard_core.formats.vllm import VLLMParallel

    config = _configs()["qwen3_moe"]
    parallel = VLLMParallel.of(range(2), enable_expert_parallel=ep)
    for rank in parallel.ranks:
        old, new = _standin_view(config, parallel, rank), _standin_view(config, parallel, rank, routed=True)
        assert new == old and old["unmapped"] == [] and old["specs"]


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_standin_names_and_shapes_equal_vllms_per_rank(tmp_path, monkeypatch, family, tp):
    vllm = pytest.importorskip("vllm")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from reshard_core.formats.vllm import VLLMParallel

    config = _configs()[family]
    config.save_pretrained(tmp_path)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    ep = family == "qwen3_moe" and tp > 1
    llm = vllm.LLM(
        model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
        enable_expert_parallel=ep, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=128,
        dtype="bfloat16",
    )  # fmt: skip

    reports = llm.collective_rpc(_make_probe())
    assert len(reports) == tp
    parallel = VLLMParallel.of(range(tp), enable_expert_parallel=ep)
    for rank, report in enumerate(reports):
        standin = _standin_view(config, parallel, rank)
        assert report["parallel"] == (parallel.tp_groups, ep)
        assert report["unmapped"] == [] and report["specs"]
        assert {**report, "parallel": None} == standin
