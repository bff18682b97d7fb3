"""Megatron-Core layouts the Megatron ⇄ transformers mapping must get right, in one 4-rank Gloo world.

Every Megatron model is a real ``GPTModel`` (local layer spec, RMSNorm, RoPE, gated SiLU, nh=8,
head dim 8, hidden 64) filled from HF tensors by ``megatron_oracle`` (independent of reshard); every
HF model is a real transformers model. Parameters are compared with ``torch.equal``, logits by
``max |HF − Megatron| < 1e-5 · spread of Megatron's logits``. Each test first checks its oracle
with no reshard involved: HF logits against the oracle-filled Megatron model's own forward
(``oracle_logits``).

- ``rotary_interleaved=True`` (Megatron rotates adjacent pairs, HF Llama halves: q/k rows permuted
  per head): Megatron TP2 → ``LlamaForCausalLM`` replicated, logits against Megatron TP1
  interleaved, and FSDP2 Llama → Megatron TP2 interleaved. A guard: Llama holding Megatron's q/k
  rows unpermuted gives clearly different logits.
- virtual pipeline: replicated Llama (4 layers) → Megatron TP2×PP2×VPP2 given as ``[chunk0, chunk1]``
  on every rank (global layer ``vp·PP + pp``), and the chunks → Llama.
- TP larger than the query groups (TP4 ng=2, TP4 ng=1, TP2 ng=1: a rank holds part of one group's
  ``linear_qkv`` block): Megatron → Llama replicated (logits against Megatron TP1) and DTensor TP4,
  and Llama → Megatron.
- ``add_bias_linear=True`` (q/k/v, o, fc1, fc2 biases): Megatron TP2 → Llama with ``attention_bias``
  and ``mlp_bias`` (logits against Megatron TP1), and FSDP2 Llama → Megatron TP2.
- a bf16 Megatron (vocab 100 padded to 128) → fp32 Llama: refused on every rank by a dtype-only
  message naming both dtypes and ``cast=True``, without the vocab-padding hint; with ``cast=True``
  the bf16 values arrive exactly.
- shared experts with the shared-expert gate and q/k/v biases (Qwen2-MoE): Megatron EP2 →
  ``Qwen2MoeForCausalLM`` (logits against Megatron EP2's forward) and Qwen2-MoE → Megatron TP2×EP2;
  Megatron shared experts without the gate → Qwen2-MoE refused on every rank, naming Megatron's
  ``moe_shared_expert_gate``.

Megatron's CPU forward uses ``test_megatron_to_hf._stubs``. With TP > ng Megatron 0.16.1's attention
takes the TP rank and all-gather group from its global state (TP1 here, models carry their own
groups), so the forward that checks that oracle points both at the model's TP group (``_attention_on``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_oracle import expected_megatron, hf_values, interleave_rope_rows
from test_megatron_to_hf import _compare, _fill, _hf_logits, _megatron_logits, _stubs, _wrong

from reshard_core.errors import ReshardError
from reshard_core.testing.world import run_world

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD = 4
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS = 64, 8, 2, 8, 96, 2
EXPERTS, MOE_FFN, SHARED_FFN = 4, 32, 48
TP_OVER_GROUPS = ((4, 2), (4, 1), (2, 1))  # (TP, num_query_groups)
RTOL = 1e-5  # logits agree: max |HF − Megatron| < RTOL · spread of Megatron's logits
Params = dict[str, torch.Tensor]


def megatron(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    groups: int = GROUPS,
    layers: int = LAYERS,
    vpp: int = 1,
    interleaved: bool = False,
    shared_gate: bool | None = None,
    biases: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A GPTModel (vocab 128) in the (tp, pp, ep) layout over the world (collective), logits gathered
    over TP; with ``vpp > 1`` the list of this rank's chunks. ``shared_gate`` not None: an MoE with
    shared experts and q/k/v biases (Qwen2-MoE), with or without the shared-expert gate. Megatron's
    default router (top-k of the logits, then softmax over those k) equals Qwen2-MoE's softmax, top-k,
    renormalised (``norm_topk_prob=True``). ``biases``: ``add_bias_linear`` (q/k/v, o, fc1 and fc2
    biases: HF Llama's ``attention_bias`` and ``mlp_bias``)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard_core.testing.models import build_pg_collection

    pgs = build_pg_collection(tp=tp, pp=pp, ep=ep)
    moe = shared_gate is not None
    extra: dict[str, Any] = {"virtual_pipeline_model_parallel_size": vpp} if vpp > 1 else {}
    if moe:
        extra.update(
            num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=2,
            expert_model_parallel_size=ep, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, add_qkv_bias=True,
            moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=shared_gate,
        )  # fmt: skip
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=groups,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=biases, normalization="RMSNorm", layernorm_epsilon=1e-6, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        rotary_interleaved=interleaved, **extra,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, normalization="RMSNorm")
    stage, chunks = pgs.pp.rank(), []
    for vp in range(vpp):
        chunk = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=16,
            pre_process=stage == 0 and vp == 0, post_process=stage == pp - 1 and vp == vpp - 1,
            position_embedding_type="rope", rotary_base=10000, pg_collection=pgs, parallel_output=False,
            vp_stage=vp if vpp > 1 else None,
        )  # fmt: skip
        chunks.append(chunk)
    return chunks if vpp > 1 else chunks[0]


def llama(*, vocab: int = 128, groups: int = GROUPS, layers: int = LAYERS, biases: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=groups, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=16,
        attention_bias=biases, mlp_bias=biases,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
        shared_expert_intermediate_size=SHARED_FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, head_dim=HEAD_DIM, qkv_bias=True, num_experts=EXPERTS,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=16,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(config)


def _filled(model, values: Params | float):
    _fill(model, values)
    return model


def _dtensor_tp4(model):
    """``model`` with q/k/v/gate/up colwise and o/down rowwise over the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        f"model.layers.*.{m}": ColwiseParallel()
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    }
    plan.update({f"model.layers.*.{m}": RowwiseParallel() for m in ("self_attn.o_proj", "mlp.down_proj")})
    return parallelize_module(model, init_device_mesh("cpu", (WORLD,)), plan)


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _expected(model, full: Params, **options) -> Params:
    """The oracle's tensors for ``model``; for a list of chunks, keyed ``chunk{i}.{name}``."""
    options = dict(heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, padded_vocab=128, tied=False) | options
    if not isinstance(model, list):
        return expected_megatron(model, full, **options)
    return {
        f"chunk{i}.{name}": t
        for i, chunk in enumerate(model)
        for name, t in expected_megatron(chunk, full, **options).items()
    }


def _differing(model, expected: Params) -> list[str]:
    """Names of ``model``'s parameters that differ from ``expected`` (chunks as in ``_expected``)."""
    if not isinstance(model, list):
        return _wrong(model, expected)
    held = {f"chunk{i}.{n}": p for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    assert sorted(held) == sorted(expected)
    return [n for n, p in held.items() if not torch.equal(p.detach(), expected[n])]


def _raised(fn: Callable[[], Any]) -> str:
    """What ``fn()`` raised, as ``"ReshardError (<class>): <text>"`` for reshard's own errors and
    ``"other (<class>): <text>"`` for anything else; ``"no error"`` when it returned."""
    try:
        fn()
    except ReshardError as exc:
        return f"ReshardError ({type(exc).__name__}): {exc}"
    except Exception as exc:  # noqa: BLE001 - reported, so the test fails with its text
        return f"other ({type(exc).__name__}): {exc}"
    return "no error"


def _refit(src, dst, expected: Callable[[], Params], **options) -> list[str] | str:
    """Refit ``src`` into ``dst`` (either may be a list of chunks): the names of ``dst``'s parameters
    that then differ from ``expected()``, or what the refit raised."""
    import reshard_core

    raised = _raised(lambda: reshard_core.refit(src, dst, **options))
    return _differing(dst, expected()) if raised == "no error" else raised


@contextlib.contextmanager
def _attention_on(model) -> Iterator[None]:
    """Point the TP rank and all-gather group that Megatron 0.16.1's attention reads from its global
    state when TP > ng at ``model``'s own TP group, for one forward."""
    import megatron.core.transformer.attention as attention

    rank = attention.get_tensor_model_parallel_rank
    gather = attention.all_gather_last_dim_from_tensor_parallel_region
    group = model.pg_collection.tp
    attention.get_tensor_model_parallel_rank = group.rank
    attention.all_gather_last_dim_from_tensor_parallel_region = lambda x: gather(x, group=group)
    try:
        yield
    finally:
        attention.get_tensor_model_parallel_rank = rank
        attention.all_gather_last_dim_from_tensor_parallel_region = gather


def _interleaved() -> dict:
    out = {}
    full = hf_values(llama(), seed=11)
    reference = megatron(interleaved=True)  # TP1
    _fill(reference, _expected(reference, full, rotary_interleaved=True))
    reference_logits = _megatron_logits(reference)
    out["oracle_logits"] = _compare(_hf_logits(_filled(llama(), full)), reference_logits)
    as_stored = {  # Megatron's q/k rows copied without regrouping pairs into halves
        n: interleave_rope_rows(t, HEAD_DIM) if re.search(r"[qk]_proj\.weight$", n) else t
        for n, t in full.items()
    }
    out["as_stored_logits"] = _compare(_hf_logits(_filled(llama(), as_stored)), reference_logits)

    src = megatron(tp=2, interleaved=True)
    out["config_interleaved"] = src.config.rotary_interleaved
    _fill(src, _expected(src, full, rotary_interleaved=True))
    hf = _filled(llama(), float("nan"))
    out["to_hf"] = _refit(src, hf, lambda: full)
    out["logits"] = _compare(_hf_logits(hf), reference_logits)

    dst = _filled(megatron(tp=2, interleaved=True), float("nan"))
    out["from_fsdp"] = _refit(
        _fsdp2(_filled(llama(), full)), dst, lambda: _expected(dst, full, rotary_interleaved=True)
    )
    return out


def _virtual_pipeline() -> dict:
    out = {}
    full = hf_values(llama(layers=4), seed=12)
    chunks = megatron(tp=2, pp=2, layers=4, vpp=2)
    out["layer_numbers"] = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
    for chunk in chunks:
        _fill(chunk, float("nan"))
    out["from_hf"] = _refit(_filled(llama(layers=4), full), chunks, lambda: _expected(chunks, full))
    for chunk in chunks:
        _fill(chunk, _expected(chunk, full))
    out["to_hf"] = _refit(chunks, _filled(llama(layers=4), float("nan")), lambda: full)
    return out


def _tp_over_groups(tp: int, groups: int) -> dict:
    out = {}
    full = hf_values(llama(groups=groups), seed=20 + tp + groups)
    hf = _filled(llama(groups=groups), full)
    src = megatron(tp=tp, groups=groups)
    _fill(src, _expected(src, full, groups=groups))
    with _attention_on(src):
        out["oracle_logits"] = _compare(_hf_logits(hf), _megatron_logits(src))

    reference = megatron(groups=groups)  # TP1
    _fill(reference, _expected(reference, full, groups=groups))
    replicated = _filled(llama(groups=groups), float("nan"))
    out["to_hf"] = _refit(src, replicated, lambda: full)
    out["logits"] = _compare(_hf_logits(replicated), _megatron_logits(reference))
    sharded = _dtensor_tp4(_filled(llama(groups=groups), float("nan")))
    out["dtensor_params"] = sum(hasattr(p, "full_tensor") for p in sharded.parameters())
    out["to_dtensor_tp4"] = _refit(src, sharded, lambda: full)
    dst = _filled(megatron(tp=tp, groups=groups), float("nan"))
    out["from_hf"] = _refit(hf, dst, lambda: _expected(dst, full, groups=groups))
    return out


def _linear_biases() -> dict:
    out = {}
    full = hf_values(llama(biases=True), seed=15)
    reference = megatron(biases=True)  # TP1
    _fill(reference, _expected(reference, full))
    out["oracle_logits"] = _compare(
        _hf_logits(_filled(llama(biases=True), full)), _megatron_logits(reference)
    )
    out["biases"] = sorted(n for n, _ in reference.named_parameters() if n.endswith(".bias"))

    src = megatron(tp=2, biases=True)
    _fill(src, _expected(src, full))
    hf = _filled(llama(biases=True), float("nan"))
    out["to_hf"] = _refit(src, hf, lambda: full)
    out["logits"] = _compare(_hf_logits(hf), _megatron_logits(reference))
    dst = _filled(megatron(tp=2, biases=True), float("nan"))
    out["from_fsdp"] = _refit(_fsdp2(_filled(llama(biases=True), full)), dst, lambda: _expected(dst, full))
    return out


def _dtype() -> dict:
    from reshard_core.formats.megatron import MegatronFormat

    out = {}
    full = hf_values(llama(vocab=100), seed=13)
    src = megatron(tp=2, dtype=torch.bfloat16)
    _fill(src, {n: t.to(torch.bfloat16) for n, t in _expected(src, full).items()})
    out["qkv_dtype"] = src.decoder.layers[0].self_attention.linear_qkv.weight.dtype
    dst = _filled(llama(vocab=100), float("nan"))
    rounded = {n: t.to(torch.bfloat16).to(torch.float32) for n, t in full.items()}
    fmt = MegatronFormat(vocab_size=100)
    out["no_cast"] = _refit(src, dst, lambda: rounded, src_format=fmt)
    out["cast"] = _refit(src, dst, lambda: rounded, src_format=fmt, cast=True)
    return out


def _shared_experts() -> dict:
    out = {}
    full = hf_values(qwen2_moe(), seed=14)
    src = megatron(ep=2, shared_gate=True)
    _fill(src, _expected(src, full))
    out["oracle_logits"] = _compare(_hf_logits(_filled(qwen2_moe(), full)), _megatron_logits(src))
    out["gates"] = sorted(n for n, _ in src.named_parameters() if n.endswith("shared_experts.gate_weight"))

    hf = _filled(qwen2_moe(), float("nan"))
    out["to_hf"] = _refit(src, hf, lambda: full)
    out["logits"] = _compare(_hf_logits(hf), _megatron_logits(src))
    back = _filled(megatron(tp=2, ep=2, shared_gate=True), float("nan"))
    out["from_hf"] = _refit(_filled(qwen2_moe(), full), back, lambda: _expected(back, full))

    ungated = _filled(megatron(ep=2, shared_gate=False), 0.0)
    out["ungated"] = _refit(ungated, _filled(qwen2_moe(), float("nan")), lambda: full)
    return out


def _world(rank: int, world: int) -> dict:
    import reshard_core
    from reshard_core.testing.models import init_megatron

    _stubs()
    init_megatron()
    out = {
        "interleaved": _interleaved(),
        "virtual_pipeline": _virtual_pipeline(),
        "tp_over_groups": {case: _tp_over_groups(*case) for case in TP_OVER_GROUPS},
        "linear_biases": _linear_biases(),
        "dtype": _dtype(),
        "shared_experts": _shared_experts(),
    }
    reshard_core.clear_caches()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(_world, WORLD, timeout=400, pg_timeout=120)


def _close(logits: tuple[float, float]) -> bool:
    diff, spread = logits
    return diff < RTOL * spread and spread > 1.0


def test_rotary_interleaved_megatron_tp2_to_llama_and_fsdp2_llama_back(results):
    for out in results:
        facts = out["interleaved"]
        # the oracle, with no reshard: regrouping each head's rotary pairs into halves is what makes
        # interleaved Megatron compute HF's logits, and the rows as stored do not
        assert facts["config_interleaved"] is True
        assert _close(facts["oracle_logits"]), facts["oracle_logits"]
        diff, spread = facts["as_stored_logits"]
        assert diff > 1e-2 * spread, (diff, spread)

        assert facts["to_hf"] == [], facts["to_hf"]
        assert _close(facts["logits"]), facts["logits"]
        assert facts["from_fsdp"] == [], facts["from_fsdp"]


def test_virtual_pipeline_chunks_from_and_to_llama(results):
    for rank, out in enumerate(results):
        facts = out["virtual_pipeline"]
        stage = rank // 2  # TP2 fastest: ranks 0, 1 are pipeline stage 0
        assert facts["layer_numbers"] == [[stage + 1], [stage + 3]]  # global: vp·PP + stage + 1
        assert facts["from_hf"] == [], facts["from_hf"]
        assert facts["to_hf"] == [], facts["to_hf"]


@pytest.mark.parametrize("case", TP_OVER_GROUPS, ids=[f"tp{tp}-ng{ng}" for tp, ng in TP_OVER_GROUPS])
def test_tp_over_groups_to_llama_replicated_and_dtensor_tp4_and_back(results, case):
    for out in results:
        facts = out["tp_over_groups"][case]
        # the oracle, with no reshard: Megatron TP > ng filled by it computes HF's logits
        assert _close(facts["oracle_logits"]), facts["oracle_logits"]

        assert facts["to_hf"] == [], facts["to_hf"]
        assert _close(facts["logits"]), facts["logits"]
        assert facts["dtensor_params"] == 7 * LAYERS  # q, k, v, o, gate, up, down per layer
        assert facts["to_dtensor_tp4"] == [], facts["to_dtensor_tp4"]
        assert facts["from_hf"] == [], facts["from_hf"]


def test_linear_biases_megatron_tp2_to_llama_and_fsdp2_llama_back(results):
    for out in results:
        facts = out["linear_biases"]
        assert facts["biases"] == [
            f"decoder.layers.{i}.{m}.bias"
            for i in range(LAYERS)
            for m in (
                "mlp.linear_fc1",
                "mlp.linear_fc2",
                "self_attention.linear_proj",
                "self_attention.linear_qkv",
            )
        ]
        assert _close(facts["oracle_logits"]), facts["oracle_logits"]
        assert facts["to_hf"] == [], facts["to_hf"]
        assert _close(facts["logits"]), facts["logits"]
        assert facts["from_fsdp"] == [], facts["from_fsdp"]


def test_a_dtype_only_difference_names_the_dtypes_and_cast_then_casts(results):
    texts = {out["dtype"]["no_cast"] for out in results}
    assert len(texts) == 1  # the same refusal on every rank
    text = texts.pop()
    assert text.startswith("ReshardError"), text
    assert "bfloat16" in text and "float32" in text, text
    assert re.search(r"only (the|in) dtype", text), text
    assert "cast=True" in text and "pads its vocab" not in text, text
    for out in results:
        assert out["dtype"]["qkv_dtype"] == torch.bfloat16
        assert out["dtype"]["cast"] == []


def test_gated_shared_experts_megatron_ep2_to_qwen2_moe_and_back_to_tp2_ep2(results):
    for out in results:
        facts = out["shared_experts"]
        # the oracle, with no reshard: Megatron EP2 filled by it computes Qwen2-MoE's logits
        assert facts["gates"] == [f"decoder.layers.{i}.mlp.shared_experts.gate_weight" for i in range(LAYERS)]
        assert _close(facts["oracle_logits"]), facts["oracle_logits"]

        assert facts["to_hf"] == [], facts["to_hf"]
        assert _close(facts["logits"]), facts["logits"]
        assert facts["from_hf"] == [], facts["from_hf"]


def test_ungated_shared_experts_to_qwen2_moe_are_refused_on_every_rank(results):
    """Qwen2-MoE gates its shared expert; a Megatron model without the gate cannot feed it. The
    refusal must say so: naming Megatron's setting, not only list ``...shared_expert_gate.weight``
    among unmatched tensors."""
    texts = {out["shared_experts"]["ungated"] for out in results}
    assert len(texts) == 1
    text = texts.pop()
    assert text.startswith("ReshardError") and "shared_expert_gate" in text, text
    assert "moe_shared_expert_gate" in text, text


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
