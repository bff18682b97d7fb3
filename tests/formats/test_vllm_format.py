"""Format "vllm" in one process: the stand-in's shapes, the layouts and views against an independent
converter for many parallel layouts, detection and declaration, and its error texts.

Each rank of an engine is simulated by building the stand-in for that rank and filling it with what
``vllm_oracle`` (docs/formats.md's formulas) says vLLM holds there; every logical spec the format gives
must then be, box by box, the HF tensor's region its layout names, and the boxes of all ranks must
cover each logical tensor.
"""

from __future__ import annotations

import math
import re
import types

import pytest
import torch
from torch import nn
from vllm_oracle import expected_vllm, hf_values

from reshard_core.errors import FormatError, PlanError
from reshard_core.extract import ExtractContext
from reshard_core.formats import declare_format, resolve_format
from reshard_core.formats.vllm import (
    PARALLEL_ATTR,
    VLLMFormat,
    VLLMParallel,
    declare_vllm,
    vllm_logical_specs,
)
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.table import TableBuilder
from reshard_core.plan.validate import validate_table
from reshard_core.preparation.coverage import coverage_problems
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM


def llama(**extra):
    from transformers import LlamaConfig

    values = dict(vocab_size=99, hidden_size=40, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=6,
                  tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(**{**values, **extra})


def qwen3_moe(**extra):
    from transformers import Qwen3MoeConfig

    values = dict(vocab_size=99, hidden_size=32, intermediate_size=24, moe_intermediate_size=24,
                  num_experts=7, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=6, mlp_only_layers=[1], tie_word_embeddings=True)  # fmt: skip
    return Qwen3MoeConfig(**{**values, **extra})


def hf_full(config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return hf_values(AutoModelForCausalLM.from_config(config), seed=5)


def logical(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors: transformers' fused experts split per expert (docs/formats.md)."""
    out = {}
    for name, t in full.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


CASES = {
    "tp1": ([(0,)], {}),
    "tp2": ([(0, 1)], {}),
    "tp4-kv-replicated": ([(3, 1, 0, 2)], {}),  # TP order is not rank order
    "tp8-kv-replicated": ([tuple(range(8))], {}),
    "tp2xdp2": ([(0, 1), (2, 3)], {}),
    "tp1xdp3-expert-tp": ([(0,), (1,), (2,)], {}),
    "ep4-linear": ([(0, 1, 2, 3)], {"enable_expert_parallel": True}),
    "ep2xdp2-round-robin": (
        [(0, 1), (2, 3)],
        {"enable_expert_parallel": True, "expert_placement": "round_robin"},
    ),
}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_logical_piece_is_the_hf_region_its_layout_names(family, case):
    groups, options = CASES[case]
    config = llama() if family == "llama" else qwen3_moe()
    full = hf_full(config)
    want = logical(full)
    parallel = VLLMParallel(tuple(groups), **options)
    held: dict[str, int] = {}
    for rank in parallel.ranks:
        model = VLLMStandInForCausalLM(config, parallel, rank)
        values, padding = expected_vllm(
            full, config, groups, rank, ep=parallel.use_ep, placement=parallel.expert_placement
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(values[name])
        out = VLLMFormat().logical_specs(model, "dst", ExtractContext(rank=rank, world=len(parallel.ranks)))
        assert out.unmapped == []
        assert sum(p.numel() for p in out.padding) == padding
        assert all(bool((p == 0).all()) for p in out.padding)  # the oracle's padding rows: nothing real
        for spec in out.specs:
            shape = tuple(spec.meta.shape)
            assert shape == tuple(want[spec.meta.name].shape), spec.meta.name
            assert tuple(spec.tensor.shape) == spec.layout.local_shape(shape, rank), spec.meta.name
            for box in spec.layout.boxes(shape, rank):
                local = spec.tensor[_slices(box.local_offsets, box.sizes)]
                region = want[spec.meta.name][_slices(box.offsets, box.sizes)]
                assert torch.equal(local, region), (spec.meta.name, rank, box)
                held[spec.meta.name] = held.get(spec.meta.name, 0) + box.numel
    replicas = {n: _replicas(s) for s in vllm_logical_specs(config, parallel) for n in [s.meta.name]}
    assert {n: held[n] // replicas[n] for n in held} == {n: t.numel() for n, t in want.items()}


def _slices(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


def _replicas(spec: TensorSpec) -> int:
    return math.prod(
        n
        for n, p in zip(spec.layout.mesh.shape, spec.layout.placements, strict=True)
        if isinstance(p, Replicate)
    )


def test_standin_has_vllms_per_rank_shapes_from_formats_md():
    config = llama()  # V 99 → V_pad 128; nh 8, ng 2, h 6; I 48
    tp4 = VLLMStandInForCausalLM(config, VLLMParallel.of(range(4)), 2)
    shapes = {n: tuple(p.shape) for n, p in tp4.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (32, 40)
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == (
        (2 + 1 + 1) * 6,
        40,
    )  # one kv head, replicated
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (40, 12)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (24, 40)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (40, 12)
    assert shapes["model.norm.weight"] == shapes["model.layers.0.input_layernorm.weight"] == (40,)
    assert len(shapes) == 3 + 2 * 6
    tp2 = VLLMStandInForCausalLM(config, VLLMParallel.of((0, 1)), 1)
    assert dict(tp2.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2) * 6, 40)
    assert all(bool(p.isnan().all()) for p in tp4.parameters())  # garbage until written

    moe = qwen3_moe(num_experts=6, moe_intermediate_size=12)  # tied: no lm_head
    ep = VLLMParallel.of(range(4), enable_expert_parallel=True)
    w13 = [
        dict(VLLMStandInForCausalLM(moe, ep, r).named_parameters())["model.layers.0.mlp.experts.w13_weight"]
        for r in range(4)
    ]
    assert [tuple(t.shape) for t in w13] == [(2, 24, 32), (2, 24, 32), (1, 24, 32), (1, 24, 32)]
    flat = VLLMStandInForCausalLM(moe, VLLMParallel.of((0, 1), dp_replicas=[(2, 3)]), 3)
    shapes = {n: tuple(p.shape) for n, p in flat.named_parameters()}
    assert shapes["model.layers.0.mlp.experts.w13_weight"] == (6, 6, 32)  # I/M, M = DP2 × TP2
    assert shapes["model.layers.0.mlp.experts.w2_weight"] == (6, 32, 3)
    assert shapes["model.layers.0.mlp.gate.weight"] == (6, 32)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (24, 32)  # dense layer: TP2 only
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (6,)
    assert "lm_head.weight" not in shapes


def test_offline_layouts_without_tensors():
    config = llama()
    specs = {s.meta.name: s for s in vllm_logical_specs(config, VLLMParallel.of((4, 5, 6, 7)))}
    assert len(specs) == 3 + 2 * 9
    k = specs["model.layers.0.self_attn.k_proj.weight"]
    assert k.layout == Layout(Mesh((4, 5, 6, 7), (2, 2)), (Shard(0), Replicate()))
    assert k.meta.dtype == torch.bfloat16 and k.tensor is None  # the config names no dtype
    f16 = vllm_logical_specs(llama(dtype="float16"), VLLMParallel.of((0,)))
    assert {s.meta.dtype for s in f16} == {torch.float16}
    assert specs["model.embed_tokens.weight"].layout.placements == (Shard(0, sizes=(32, 32, 32, 3)),)
    assert specs["model.layers.0.self_attn.o_proj.weight"].layout.placements == (Shard(1),)
    dp = {s.meta.name: s for s in vllm_logical_specs(config, VLLMParallel.of((0, 1), dp_replicas=[(2, 3)]))}
    assert dp["model.layers.0.mlp.gate_proj.weight"].layout == Layout(
        Mesh((0, 1, 2, 3), (2, 2)), (Replicate(), Shard(0))
    )
    moe = qwen3_moe(num_experts=6, moe_intermediate_size=12)
    ep = VLLMParallel.of(range(4), enable_expert_parallel=True)
    down = re.compile(r"model\.layers\.0\.mlp\.experts\.\d+\.down_proj\.weight")
    owners = [s.layout.mesh.ranks for s in vllm_logical_specs(moe, ep) if down.fullmatch(s.meta.name)]
    assert owners == [(0,), (0,), (1,), (1,), (2,), (3,)]
    mine = [s.meta.name for s in vllm_logical_specs(moe, ep, rank=2) if ".experts." in s.meta.name]
    assert mine == [f"model.layers.0.mlp.experts.4.{p}_proj.weight" for p in ("gate", "up", "down")]


def test_detection_and_declaration():
    fmt = resolve_format(VLLMStandInForCausalLM(llama(), VLLMParallel.of((0,)), 0), None)
    assert fmt.name == "vllm"
    real = type("LlamaForCausalLM", (nn.Module,), {"__module__": "vllm.model_executor.models.llama"})
    assert VLLMFormat().detect(real()) and not VLLMFormat().detect(nn.Linear(2, 2))
    from transformers import LlamaForCausalLM

    assert resolve_format(LlamaForCausalLM(llama()), None).name == "hf"

    class Engine(nn.Module):  # a custom engine with vLLM's names: declared, not detected
        pass

    engine = Engine()
    engine.config = llama(num_hidden_layers=0)
    for name in ("embed_tokens", "norm"):
        setattr(engine, name, nn.Linear(1, 1))
    assert resolve_format(engine, None) is None
    parallel = VLLMParallel.of((0,))
    assert declare_vllm(engine, parallel) is engine
    assert resolve_format(engine, None).name == "vllm" and getattr(engine, PARALLEL_ATTR) is parallel
    assert declare_format(Engine(), "vllm") is not None


def _specs(model, rank=0):
    return VLLMFormat().logical_specs(model, "dst", ExtractContext(rank=rank, world=4))


def test_an_engine_whose_shapes_do_not_fit_its_description_names_every_parameter():
    engine = VLLMStandInForCausalLM(llama(num_hidden_layers=1), VLLMParallel.of((0, 1)), 0)
    setattr(engine, PARALLEL_ATTR, VLLMParallel.of((0, 1, 2, 3)))  # declared wrongly: TP4
    del engine.model.norm
    with pytest.raises(FormatError) as info:
        _specs(engine)
    assert str(info.value) == (
        "format 'vllm' on rank 0: the config and parallel description imply 1 parameter missing: "
        "model.norm.weight and 6 parameters with another local shape: "
        "model.embed_tokens.weight (64, 40), expected (32, 40); "
        "model.layers.0.self_attn.qkv_proj.weight (36, 40), expected (24, 40); "
        "model.layers.0.self_attn.o_proj.weight (40, 24), expected (40, 12); "
        "model.layers.0.mlp.gate_up_proj.weight (48, 40), expected (24, 40); "
        "model.layers.0.mlp.down_proj.weight (40, 24), expected (40, 12); "
        "lm_head.weight (64, 40), expected (32, 40)"
    )


@pytest.mark.parametrize(
    ("config", "parallel", "text"),
    [
        (llama, VLLMParallel.of(range(16)), "num_attention_heads (8) is not divisible by the TP size (16)"),
        (lambda: llama(num_attention_heads=12, num_key_value_heads=3, hidden_size=48),
         VLLMParallel.of(range(4)),
         "the TP size (4) is not divisible by num_key_value_heads (3)"),
        (lambda: qwen3_moe(moe_intermediate_size=12), VLLMParallel.of(range(8)),
         "moe_intermediate_size (12) is not divisible by DP × TP (8)"),
        (lambda: llama(num_attention_heads=6, num_key_value_heads=3, hidden_size=48),
         VLLMParallel.of(range(3)),
         "the padded vocab (128) is not divisible by the TP size (3)"),
        (lambda: types.SimpleNamespace(model_type="gpt2"), VLLMParallel.of((0,)),
         "knows model types deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mistral, qwen2, qwen2_moe, "
         "qwen3, qwen3_moe, qwen3_next, not 'gpt2'"),
    ],
)  # fmt: skip
def test_configs_the_convention_cannot_split_are_named(config, parallel, text):
    with pytest.raises(FormatError) as info:
        vllm_logical_specs(config(), parallel)
    assert str(info.value) == ("format 'vllm' " if text.startswith("knows") else "format 'vllm': ") + text


def test_a_model_without_a_parallel_description_is_named():
    class Engine(nn.Module):
        pass

    with pytest.raises(FormatError) as info:
        _specs(declare_format(Engine(), "vllm"))
    assert str(info.value) == (
        f"format 'vllm': the model has no {PARALLEL_ATTR} attribute; declare it with "
        "reshard_core.formats.declare_vllm(model, VLLMParallel(...)), or refit a vLLM engine through "
        "reshard-vllm, which reads it from vLLM's process groups"
    )


def test_parallel_description_checks():
    with pytest.raises(ValueError, match=r"^VLLMParallel: TP groups of different sizes \[2, 1\]$"):
        VLLMParallel.of((0, 1), dp_replicas=[(2,)])
    with pytest.raises(ValueError, match=r"^VLLMParallel: a rank appears twice in \(\(0, 1\), \(1, 2\)\)$"):
        VLLMParallel.of((0, 1), dp_replicas=[(1, 2)])
    assert VLLMParallel.of(range(4), enable_expert_parallel=True).experts_of(6) == [[0, 1], [2, 3], [4], [5]]
    rr = VLLMParallel.of(range(4), enable_expert_parallel=True, expert_placement="round_robin")
    assert rr.experts_of(6) == [[0, 4], [1, 5], [2], [3]]
    assert not VLLMParallel.of((0,), enable_expert_parallel=True).use_ep  # one rank: nothing to split


# ---------------------------------------------------------------- the generic messages it relies on


def _table(src, dst):
    b = TableBuilder()
    for side, items in (("src", src), ("dst", dst)):
        for name, ranks in items:
            layout = Layout.replicated(ranks)
            for r in ranks:
                b.add(side, r, TensorMeta(name, (4,), torch.float32), layout)
    return b.build()


def test_every_one_sided_name_is_listed_and_counted():
    table = _table(
        [("a", (0, 1)), ("s1", (0, 1)), ("s2", (0, 1))], [("a", (2, 3)), ("d1", (2, 3)), ("d2", (3,))]
    )
    with pytest.raises(PlanError) as info:
        validate_table(table)
    assert str(info.value) == (
        "2 tensors on the source only (ranks [0, 1]), no destination holds them: s1, s2; pass ignore= with "
        "their names to leave them out; 2 tensors on the destination only, no source holds them: "
        "d1 (ranks [2, 3]), d2 (ranks [3]); pass ignore= with their names to leave them out, or tied= to "
        "feed them from other tensors"
    )
    validate_table(table, ignore=["s*", "d*"])


def test_a_logical_tensor_that_is_no_view_of_the_model_is_named():
    model = nn.Linear(4, 2, bias=False)
    copy = model.weight.detach().clone()
    spec = TensorSpec(TensorMeta("w", (2, 4), torch.float32), Layout.replicated((0,)), copy)
    assert coverage_problems(model, [spec], [], "mine") == [
        "format 'mine' gives 1 destination logical tensor that is no view of the model's tensors "
        "(writes would be lost): w"
    ]
    fine = TensorSpec(spec.meta, spec.layout, model.weight.detach()[:, :3])
    pad = model.weight.detach()[:, 3:]
    assert coverage_problems(model, [fine], [pad], "mine") == []


def test_index_buffers_are_left_alone_and_unknown_weights_are_unmapped():
    model = VLLMStandInForCausalLM(llama(num_hidden_layers=1), VLLMParallel.of((0,)), 0)
    model.model.layers[0].mlp.register_buffer("_expert_map", torch.arange(4, dtype=torch.int32))
    model.model.layers[0].mlp.register_buffer("scale", torch.ones(4))
    assert _specs(model).unmapped == ["model.layers.0.mlp.scale"]
