"""Megatron-Core GPTModel ⇄ transformers models, shard to shard, in one 4-rank Gloo world.

Every Megatron model here is a real ``GPTModel`` (local layer spec, RMSNorm, RoPE, gated SiLU, no
biases, nh=8, ng=2, fp32) whose parameters are filled from HF tensors by ``megatron_oracle`` (an
independent converter written from docs/formats.md); every HF model is a real transformers model.

- dense, vocab 100 padded to 128 (NaN padding rows), untied: Megatron TP2 (×DP2) → ``LlamaForCausalLM``
  replicated and DTensor-TP4 (colwise q/k/v/gate/up, rowwise o/down), with
  ``src_format=MegatronFormat(vocab_size=100)``; HF logits against Megatron TP1 logits. Reverse: HF
  FSDP2 → Megatron TP2 whose parameters held NaN: padding rows zero afterwards.
- dense, vocab 128, tied: Megatron TP2PP2 (the last stage's ``output_layer`` is a replica of the
  embedding) → tied Llama, and back to Megatron TP1PP2, with ``refit(src, dst)`` alone (formats
  detected).
- MoE: Megatron EP2 (SequentialMLP experts, router, q/k layernorm) → ``Qwen3MoeForCausalLM`` and
  Qwen3-MoE → Megatron TP2×EP2, formats detected; HF logits against Megatron EP2's forward.
- a TP2 model with one multi-token-prediction layer maps every parameter, the MTP layer under
  DeepSeek-V3's names (``model.layers.2.{enorm,hnorm,eh_proj,shared_head.norm}``, ``self_attn``, ...).
- the errors a user meets: a padded vocab given to no format (with its hint), and a
  Megatron setting with no mapping (learned position embeddings), refused by name on every rank.

Megatron's forward runs on CPU with stubs: ``torch.cuda.current_device`` → "cpu", the CUDA RNG
tracker's ``fork`` → a null context, MoE's ``te_general_gemm`` → None (0.16.1 references it without
Transformer Engine), and, while a tied model with PP>1 is built, ``Tensor.cuda`` → identity.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from megatron_oracle import expected_megatron, hf_values

from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD = 4
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS = 64, 8, 2, 8, 96, 2
EXPERTS, MOE_FFN = 4, 32
ATTN = dict(heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM)
IDS = torch.tensor([[3, 17, 42, 99, 0, 64, 7], [88, 5, 23, 61, 12, 90, 31]])


def _stubs() -> None:
    """Let Megatron's forward run on CPU (see the module docstring)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None


def build_megatron(tp=1, pp=1, ep=1, *, vocab=128, tied=False, moe=False, rope=True, mtp=False):
    """A GPTModel in the (tp, pp, ep) layout over the world (collective); parameters uninitialised.
    ``mtp`` adds one multi-token-prediction layer."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard_core.testing.models import build_pg_collection

    pgs = build_pg_collection(tp=tp, pp=pp, ep=ep)
    extra = {}
    if moe:
        extra = dict(
            num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=2,
            expert_model_parallel_size=ep, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, qk_layernorm=True,
        )  # fmt: skip
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=1 if mtp else None, **extra,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS if moe else None, normalization="RMSNorm", qk_layernorm=moe
    )
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied PP>1: the constructor all-reduces on "cuda"
    try:
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=16,
            pre_process=pgs.pp.rank() == 0, post_process=pgs.pp.rank() == pp - 1,
            share_embeddings_and_output_weights=tied, rotary_base=10000, pg_collection=pgs,
            position_embedding_type="rope" if rope else "learned_absolute", mtp_block_spec=mtp_spec,
        )  # fmt: skip
    finally:
        torch.Tensor.cuda = cuda


def llama(vocab: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=GROUPS,
            head_dim=HEAD_DIM,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=tied,
            max_position_embeddings=16,
        )  # fmt: skip
    )


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            moe_intermediate_size=MOE_FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=GROUPS,
            head_dim=HEAD_DIM,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            max_position_embeddings=16,
        )  # fmt: skip
    )


def _fill(model, values: dict[str, torch.Tensor] | float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name]) if isinstance(values, dict) else p.fill_(values)


def _wrong(model, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of ``model``'s parameters that differ from ``expected`` (DTensors compared whole)."""
    held = dict(model.named_parameters())
    assert sorted(held) == sorted(expected)
    out = []
    for name, p in held.items():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective: same order on every rank
        if not torch.equal(value.detach(), expected[name]):
            out.append(name)
    return out


def _megatron_logits(model) -> torch.Tensor:
    s = IDS.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(IDS, torch.arange(s).expand_as(IDS), mask)


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _compare(hf: torch.Tensor, megatron: torch.Tensor) -> tuple[float, float]:
    """(max |HF − Megatron|, spread of Megatron's logits: the largest minus the smallest)."""
    assert hf.shape == megatron.shape, (hf.shape, megatron.shape)
    return float((hf - megatron).abs().max()), float(megatron.max() - megatron.min())


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the text is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _padded_untied(rank: int) -> dict:
    import reshard_core
    from reshard_core.formats.megatron import MegatronFormat

    out = {}
    fmt = MegatronFormat(vocab_size=100)
    full = hf_values(llama(100, tied=False), seed=1)
    src = build_megatron(tp=2, vocab=128)
    _fill(src, expected_megatron(src, full, **ATTN, padded_vocab=128, tied=False, pad=float("nan")))

    hf = llama(100, tied=False)
    _fill(hf, float("nan"))
    report = reshard_core.refit(src, hf, src_format=fmt)
    real = sum(p.numel() for p in hf.parameters()) * 4
    out["to_replicated"] = _wrong(hf, full)
    out["to_replicated_bytes"] = (report.bytes_received + report.bytes_local, real)

    reference = build_megatron(tp=1, vocab=128)  # Megatron TP1 on every rank, for logits
    _fill(reference, expected_megatron(reference, full, **ATTN, padded_vocab=128, tied=False))
    out["logits"] = _compare(_hf_logits(hf), _megatron_logits(reference)[..., :100])

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_hf = llama(100, tied=False)
    _fill(tp_hf, float("nan"))
    plan = {
        f"model.layers.*.{m}": ColwiseParallel()
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    }
    plan.update({f"model.layers.*.{m}": RowwiseParallel() for m in ("self_attn.o_proj", "mlp.down_proj")})
    parallelize_module(tp_hf, init_device_mesh("cpu", (WORLD,)), plan)
    reshard_core.refit(src, tp_hf, src_format=fmt)
    out["to_dtensor_tp4"] = _wrong(tp_hf, full)
    out["dtensor_params"] = sum(hasattr(p, "full_tensor") for p in tp_hf.parameters())

    from torch.distributed.fsdp import fully_shard

    fsdp = llama(100, tied=False)
    _fill(fsdp, full)
    for layer in fsdp.model.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    dst = build_megatron(tp=2, vocab=128)
    _fill(dst, float("nan"))
    reshard_core.refit(fsdp, dst, dst_format=fmt)
    out["from_fsdp"] = _wrong(
        dst, expected_megatron(dst, full, **ATTN, padded_vocab=128, tied=False, pad=0.0)
    )

    # no vocab_size: the padded vocab is taken as real and the shapes disagree
    out["no_vocab_size"] = _error(lambda: reshard_core.refit(src, llama(100, tied=False)))
    learned = build_megatron(tp=2, vocab=128, rope=False)
    out["unmapped"] = _error(lambda: reshard_core.refit(learned, llama(128, tied=False)))
    return out


def _tied_pipeline(rank: int) -> dict:
    import reshard_core
    from reshard_core.formats import resolve_format

    out = {}
    full = hf_values(llama(128, tied=True), seed=2)
    src = build_megatron(tp=2, pp=2, tied=True)
    _fill(src, expected_megatron(src, full, **ATTN, padded_vocab=128, tied=True))
    hf = llama(128, tied=True)
    _fill(hf, float("nan"))
    out["formats"] = (resolve_format(src, None).name, resolve_format(hf, None).name)
    out["names"] = sorted(n for n, _ in src.named_parameters() if "embedding" in n or "output" in n)
    reshard_core.refit(src, hf)
    out["to_hf"] = _wrong(hf, full)
    reference = build_megatron(tp=1, tied=True)
    _fill(reference, expected_megatron(reference, full, **ATTN, padded_vocab=128, tied=True))
    out["logits"] = _compare(_hf_logits(hf), _megatron_logits(reference))

    back = build_megatron(tp=1, pp=2, tied=True)  # TP1: each rank's q_proj is two groups' rows (a SplitView)
    _fill(back, float("nan"))
    reshard_core.refit(hf, back)
    out["from_hf"] = _wrong(back, expected_megatron(back, full, **ATTN, padded_vocab=128, tied=True))
    return out


def _moe(rank: int) -> dict:
    import reshard_core

    out = {}
    full = hf_values(qwen3_moe(), seed=3)
    src = build_megatron(ep=2, moe=True)
    _fill(src, expected_megatron(src, full, **ATTN, padded_vocab=128, tied=False))
    hf = qwen3_moe()
    _fill(hf, float("nan"))
    reshard_core.refit(src, hf)
    out["to_hf"] = _wrong(hf, full)
    out["logits"] = _compare(_hf_logits(hf), _megatron_logits(src))

    back = build_megatron(tp=2, ep=2, moe=True)
    _fill(back, float("nan"))
    reshard_core.refit(hf, back)
    out["from_hf"] = _wrong(back, expected_megatron(back, full, **ATTN, padded_vocab=128, tied=False))
    out["experts_held"] = list(back.decoder.layers[0].mlp.local_expert_indices)
    return out


def _mtp_names(rank: int) -> dict:
    """The logical names of a TP2 model with one MTP layer (DeepSeek-V3's: layer ``num_layers``)."""
    from reshard_core.extract import ExtractContext
    from reshard_core.formats.megatron import MegatronFormat

    model = build_megatron(tp=2, mtp=True)
    mapped = MegatronFormat().logical_specs(model, "src", ExtractContext.create())
    return {
        "names": sorted(s.meta.name for s in mapped.specs),
        "unmapped": mapped.unmapped,
        "physical": sorted(n for n, _ in model.named_parameters() if n.startswith("mtp.")),
    }


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.testing.models import init_megatron

    _stubs()
    init_megatron()
    out = {"padded_untied": _padded_untied(rank), "tied_pipeline": _tied_pipeline(rank), "moe": _moe(rank)}
    out["mtp"] = _mtp_names(rank)
    reshard_core.clear_caches()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=400, pg_timeout=120)


def test_megatron_tp2_padded_vocab_to_llama_replicated_and_dtensor_tp4_bit_exact(results):
    for out in results:
        facts = out["padded_untied"]
        assert facts["to_replicated"] == [] and facts["to_dtensor_tp4"] == []
        assert facts["dtensor_params"] == 7 * LAYERS  # q, k, v, o, gate, up, down per layer
        moved, real = facts["to_replicated_bytes"]
        assert moved == real  # the HF model's real elements, no padding row


def test_hf_logits_equal_megatron_logits(results):
    """Megatron TP1 for the dense models, Megatron EP2's own forward for MoE."""
    for out in results:
        for case in ("padded_untied", "tied_pipeline", "moe"):
            diff, spread = out[case]["logits"]
            assert diff < 1e-4 and spread > 1.0, (case, diff, spread)


def test_fsdp2_llama_to_megatron_tp2_zeroes_padding_that_held_nan(results):
    for out in results:
        assert out["padded_untied"]["from_fsdp"] == []


def test_tied_tp2pp2_to_tied_llama_and_back_to_tp1pp2_with_detected_formats(results):
    for rank, out in enumerate(results):
        facts = out["tied_pipeline"]
        assert facts["formats"] == ("megatron", "hf")
        first_stage = rank < 2
        assert facts["names"] == (
            ["embedding.word_embeddings.weight"] if first_stage else ["output_layer.weight"]
        )
        assert facts["to_hf"] == [] and facts["from_hf"] == []


def test_megatron_ep2_moe_to_qwen3_moe_and_back_to_tp2_ep2(results):
    for rank, out in enumerate(results):
        facts = out["moe"]
        assert facts["to_hf"] == [] and facts["from_hf"] == []
        assert facts["experts_held"] == ([0, 1] if rank < 2 else [2, 3])


def test_mtp_layers_are_named_like_deepseek_v3_layers_after_the_decoder(results):
    layer = [f"model.layers.2.{n}" for n in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
    )]  # fmt: skip
    dense = {n for n, _ in llama(128, tied=False).named_parameters()}
    for out in results:
        facts = out["mtp"]
        assert facts["unmapped"] == []
        assert facts["names"] == sorted(dense | set(layer))
        assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in facts["physical"]


def test_a_padded_vocab_without_vocab_size_is_explained(results):
    for out in results:
        assert out["padded_untied"]["no_vocab_size"] == (
            "PlanError: lm_head.weight: source shape (128, 64) float32 on ranks [0-3] but destination shape "
            "(100, 64) float32 on ranks [0-3]; if one side pads its vocab (Megatron pads it to a multiple of "
            "make_vocab_size_divisible_by·TP), give its format the real size, e.g. "
            "src_format=MegatronFormat(vocab_size=V) (from reshard_core.formats.megatron)"
        )


def test_learned_position_embeddings_are_refused_by_name_on_every_rank(results):
    for out in results:
        assert out["padded_untied"]["unmapped"] == (
            "PlanError: ranks [0-3]: position_embedding_type='learned_absolute' is not supported by "
            "format 'megatron': its learned position embeddings (embedding.position_embeddings.weight) "
            "are not mapped"
        )


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
