"""Megatron-Core → vLLM's convention at TP4, directly, in one 4-rank Gloo world.

The source is a real ``GPTModel`` (local layer spec, RMSNorm, gated MLP, no biases, nh=8, untied
output) whose shards are filled, by formulas written here from docs/formats.md, with the HF tensors of
one Llama model (group-major ``linear_qkv``, ``[gate_s; up_s]`` fc1). Three sources: TP2 (×DP2) with
ng=2, and TP4 with ng=2 and ng=1, where TP exceeds the query groups and Megatron splits the fused
``linear_qkv`` rows evenly, so a rank holds part of one group's block. The destination is the vLLM
stand-in at TP4, where each kv head is replicated over TP/ng ranks and the vocab of 100 is padded
to 128 rows. ``refit(src, dst)`` takes no format argument ("megatron" and "vllm" are
detected) and must land ``vllm_oracle``'s values bit for bit, padding zero, each rank receiving only
the real elements it does not copy locally.

Needs the "megatron" format (``reshard_core.formats.megatron``); skipped until it is there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from vllm_oracle import expected_vllm

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytest.importorskip("reshard_core.formats.megatron")
pytestmark = pytest.mark.slow

WORLD = 4
CASES = {"tp2_ng2": (2, 2), "tp4_ng2": (4, 2), "tp4_ng1": (4, 1)}
"""Source (Megatron TP, query groups) per case."""
SIZES = dict(vocab=100, hidden=64, inter=96, heads=8, head_dim=8, layers=2)


def llama_config(groups: int):
    from transformers import LlamaConfig

    s = SIZES
    return LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=groups,
        head_dim=s["head_dim"], tie_word_embeddings=False,
    )  # fmt: skip


def hf_tensors(groups: int) -> dict[str, torch.Tensor]:
    """The logical (HF) tensors, the same on every rank."""
    from transformers import LlamaForCausalLM
    from vllm_oracle import hf_values

    return hf_values(LlamaForCausalLM(llama_config(groups)), seed=3)


def megatron_shard(full: dict[str, torch.Tensor], name: str, s: int, tp: int, ng: int) -> torch.Tensor:
    """TP rank ``s``'s piece of Megatron parameter ``name`` (docs/formats.md: Megatron ← HF)."""
    h, nh = SIZES["head_dim"], SIZES["heads"]
    p = nh // ng
    rows = lambda t: t.chunk(tp)[s]  # noqa: E731
    cols = lambda t: t.chunk(tp, dim=1)[s]  # noqa: E731
    if name == "embedding.word_embeddings.weight":
        return rows(full["model.embed_tokens.weight"])
    if name == "output_layer.weight":
        return rows(full["lm_head.weight"])
    if name == "decoder.final_layernorm.weight":
        return full["model.norm.weight"]
    _, _, n, *rest = name.split(".")
    hf, what = f"model.layers.{n}.", ".".join(rest)
    if what == "self_attention.linear_qkv.weight":
        q, k, v = (full[hf + f"self_attn.{x}_proj.weight"] for x in "qkv")
        blocks = []
        for g in range(ng):  # group-major: p query heads, then k_g, then v_g; TP splits the rows evenly
            blocks += [q[g * p * h : (g + 1) * p * h], k[g * h : (g + 1) * h], v[g * h : (g + 1) * h]]
        return rows(torch.cat(blocks))
    simple = {
        "self_attention.linear_proj.weight": (cols, "self_attn.o_proj.weight"),
        "mlp.linear_fc2.weight": (cols, "mlp.down_proj.weight"),
        "input_layernorm.weight": (None, "input_layernorm.weight"),
        "pre_mlp_layernorm.weight": (None, "post_attention_layernorm.weight"),
    }
    if what == "mlp.linear_fc1.weight":
        return torch.cat([rows(full[hf + "mlp.gate_proj.weight"]), rows(full[hf + "mlp.up_proj.weight"])])
    cut, key = simple[what]
    return cut(full[hf + key]) if cut else full[hf + key]


def build_megatron(full: dict[str, torch.Tensor], tp: int, ng: int):
    """Megatron TP ``tp`` (× DP) over the world with ``ng`` query groups, shards filled from ``full``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard_core.testing.models import build_pg_collection, init_megatron

    init_megatron()
    pgs = build_pg_collection(tp=tp)
    s = SIZES
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_query_groups=ng, kv_channels=s["head_dim"], ffn_hidden_size=s["inter"],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=s["vocab"], max_sequence_length=16, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", pg_collection=pgs,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(megatron_shard(full, name, pgs.tp.rank(), tp, ng))
    return model


def _world(rank: int, world: int) -> dict:
    return {case: _case(rank, *tp_ng) for case, tp_ng in CASES.items()}


def _case(rank: int, tp: int, ng: int) -> dict:
    import reshard_core
    from reshard_core.formats import resolve_format
    from reshard_core.formats.vllm import VLLMParallel
    from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM

    full = hf_tensors(ng)
    src = build_megatron(full, tp, ng)
    config = llama_config(ng)
    dst = VLLMStandInForCausalLM(config, VLLMParallel.of(range(WORLD)), rank)
    held = dict(dst.named_parameters())
    expected, padding = expected_vllm(full, config, [tuple(range(WORLD))], rank)
    report = reshard_core.refit(src, dst)
    out = {
        "formats": (resolve_format(src, None).name, resolve_format(dst, None).name),
        "names": sorted(held) == sorted(expected),
        "wrong": sorted(n for n in expected if not torch.equal(held[n], expected[n])),
        "padding": padding,
        "bytes": (
            report.bytes_received,
            report.bytes_local,
            (sum(t.numel() for t in held.values()) - padding) * 4,
        ),
    }
    reshard_core.clear_caches()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=300, pg_timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_megatron_to_vllm_tp4_is_exact_and_moves_only_needed_slices(results, case):
    for rank in range(WORLD):
        facts = results[rank][case]
        assert facts["formats"] == ("megatron", "vllm")
        assert facts["names"] and facts["wrong"] == []
        received, local, real = facts["bytes"]
        assert received == real - local
    assert [results[r][case]["padding"] for r in range(WORLD)] == [0, 0, 0, 2 * 28 * SIZES["hidden"]]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
