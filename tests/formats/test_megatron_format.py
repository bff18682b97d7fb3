"""Format "megatron" on hand-made specs, single process: names, logical layouts, local views.

Physical Megatron tensors are built here from HF tensors by docs/formats.md's formulas (group-major
``linear_qkv``, ``[gate; up]`` fc1 cut with stride 2, vocab padded with rows past V); each rank's
piece is cut by the physical layout. Every logical local view must equal that rank's chunk of the
HF tensor under the logical layout, and writing HF values through the views must rebuild the
rank's physical piece (a destination is written in place). Offline (``tensor=None``) layouts must
equal the live ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from reshard_core.errors import FormatError
from reshard_core.formats import resolve_format
from reshard_core.formats.megatron import MegatronConfig, MegatronFormat, megatron_logical_specs
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.views import SplitView, copy_into, materialize

H = 6  # hidden size
HEAD = 4  # kv_channels


def _config(nh=8, ng=2, **kw) -> MegatronConfig:
    return MegatronConfig(num_attention_heads=nh, num_query_groups=ng, kv_channels=HEAD, **kw)


def _piece(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s local piece of ``full`` under ``layout`` (a copy)."""
    local = full
    for d, ivs in enumerate(layout.dim_intervals(tuple(full.shape), rank)):
        local = torch.cat([local.narrow(d, a, b - a) for a, b in ivs], dim=d)
    return local.clone()


def _spec(name: str, full: torch.Tensor, layout: Layout, rank: int) -> TensorSpec:
    return TensorSpec(TensorMeta(name, tuple(full.shape), full.dtype), layout, _piece(full, layout, rank))


def _tp(width: int, placement) -> Layout:
    return Layout(Mesh.of(range(width)), (placement,))


def _dense(t) -> torch.Tensor:
    return materialize(t.region([0] * t.dim(), tuple(t.shape))) if isinstance(t, SplitView) else t


def _write(spec: TensorSpec, values: torch.Tensor) -> None:
    t = spec.tensor
    copy_into(t.region([0] * t.dim(), tuple(t.shape)) if isinstance(t, SplitView) else t, values)


def _linear_qkv(q, k, v, nh, ng):
    """docs/formats.md: group g is rows [g·B, (g+1)·B) = [q heads g·p .. g·p+p-1; k_g; v_g]."""
    p = nh // ng
    blocks = []
    for g in range(ng):
        blocks += [
            q[g * p * HEAD : (g + 1) * p * HEAD],
            k[g * HEAD : (g + 1) * HEAD],
            v[g * HEAD : (g + 1) * HEAD],
        ]
    return torch.cat(blocks)


@pytest.mark.parametrize("ng", [2, 4])
@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_tp2_linear_qkv_regroups_into_q_k_v_in_place(ng, kind):
    nh, tp = 8, 2
    shape = (lambda n: (n, H)) if kind == "weight" else (lambda n: (n,))
    q = torch.randn(shape(nh * HEAD))
    k, v = torch.randn(shape(ng * HEAD)), torch.randn(shape(ng * HEAD))
    fused = _linear_qkv(q, k, v, nh, ng)
    layout = _tp(tp, Shard(0))
    for rank in range(tp):
        spec = _spec(f"decoder.layers.3.self_attention.linear_qkv.{kind}", fused, layout, rank)
        got = megatron_logical_specs(spec, _config(nh, ng), rank)
        names = [s.meta.name for s in got]
        assert names == [f"model.layers.3.self_attn.{x}_proj.{kind}" for x in "qkv"]
        for logical, full in zip(got, (q, k, v), strict=True):
            assert logical.meta.shape == tuple(full.shape) and logical.layout == layout
            assert isinstance(logical.tensor, SplitView) == (ng // tp > 1)  # several groups per rank
            assert torch.equal(_dense(logical.tensor), full.chunk(tp)[rank])
        spec.tensor.zero_()
        for logical, full in zip(got, (q, k, v), strict=True):
            _write(logical, full.chunk(tp)[rank])
        assert torch.equal(spec.tensor, fused.chunk(tp)[rank])


def test_a_linear_qkv_that_does_not_match_the_config_is_named():
    spec = TensorSpec(
        TensorMeta("decoder.layers.0.self_attention.linear_qkv.weight", (40, H), torch.float32),
        _tp(2, Shard(0)),
        None,
    )
    with pytest.raises(FormatError) as info:
        megatron_logical_specs(spec, _config(8, 2), 0)
    assert str(info.value) == (
        "decoder.layers.0.self_attention.linear_qkv.weight has 40 rows; "
        "num_query_groups·(heads/groups + 2)·kv_channels = 2·6·4 = 48"
    )


@pytest.mark.parametrize(
    ("name", "prefix"),
    [
        ("decoder.layers.1.mlp.linear_fc1.weight", "model.layers.1.mlp."),
        ("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight", "model.layers.1.mlp.experts.5."),
        ("decoder.layers.1.mlp.experts.linear_fc1.weight5", "model.layers.1.mlp.experts.5."),
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", "model.layers.1.mlp.shared_experts."),
    ],
)
def test_gated_fc1_with_stride_2_splits_into_gate_and_up(name, prefix):
    inter, tp = 8, 2
    gate, up = torch.randn(inter, H), torch.randn(inter, H)
    fused = torch.cat([gate, up])
    layout = _tp(tp, Shard(0, stride=2))
    for rank in range(tp):
        spec = _spec(name, fused, layout, rank)
        assert torch.equal(
            spec.tensor, torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        )  # [gate_s; up_s]
        g, u = megatron_logical_specs(spec, _config(), rank)
        assert (g.meta.name, u.meta.name) == (prefix + "gate_proj.weight", prefix + "up_proj.weight")
        assert g.layout == u.layout == _tp(tp, Shard(0))
        assert torch.equal(g.tensor, gate.chunk(tp)[rank]) and torch.equal(u.tensor, up.chunk(tp)[rank])
        assert g.tensor.data_ptr() == spec.tensor.data_ptr()  # a view of the parameter


def test_fc2_router_norms_and_not_gated_fc1_are_renamed():
    config = _config()
    cases = {
        "decoder.layers.2.mlp.linear_fc2.weight": "model.layers.2.mlp.down_proj.weight",
        "decoder.layers.2.mlp.experts.linear_fc2.weight7": "model.layers.2.mlp.experts.7.down_proj.weight",
        "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight": (
            "model.layers.2.mlp.experts.7.down_proj.weight"
        ),
        "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": (
            "model.layers.2.mlp.shared_experts.down_proj.weight"
        ),
        "decoder.layers.2.mlp.router.weight": "model.layers.2.mlp.gate.weight",
        "decoder.layers.2.mlp.router.expert_bias": "model.layers.2.mlp.gate.e_score_correction_bias",
        "decoder.layers.2.self_attention.linear_proj.weight": "model.layers.2.self_attn.o_proj.weight",
        "decoder.layers.2.self_attention.q_layernorm.weight": "model.layers.2.self_attn.q_norm.weight",
        "decoder.layers.2.self_attention.k_layernorm.weight": "model.layers.2.self_attn.k_norm.weight",
        "decoder.layers.2.input_layernorm.weight": "model.layers.2.input_layernorm.weight",
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": (
            "model.layers.2.input_layernorm.weight"
        ),
        "decoder.layers.2.pre_mlp_layernorm.weight": "model.layers.2.post_attention_layernorm.weight",
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight": "model.layers.2.post_attention_layernorm.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    layout = _tp(2, Shard(1))
    for name, logical in cases.items():
        spec = TensorSpec(TensorMeta(name, (4, 4), torch.float32), layout, torch.zeros(4, 2))
        (got,) = megatron_logical_specs(spec, config, 0)
        assert (got.meta.name, got.layout, got.tensor) == (logical, layout, spec.tensor), name
    fc1 = TensorSpec(
        TensorMeta("decoder.layers.0.mlp.linear_fc1.weight", (8, 4), torch.float32), layout, None
    )
    (up,) = megatron_logical_specs(fc1, _config(gated_linear_unit=False), 0)
    assert (up.meta.name, up.meta.shape) == ("model.layers.0.mlp.up_proj.weight", (8, 4))


def test_mtp_layers_take_deepseek_v3_layer_numbers_after_the_decoder():
    config = _config(num_layers=4)
    rep = _tp(2, Replicate())
    names = {
        "mtp.layers.1.enorm.weight": "model.layers.5.enorm.weight",
        "mtp.layers.1.hnorm.weight": "model.layers.5.hnorm.weight",
        "mtp.layers.1.eh_proj.weight": "model.layers.5.eh_proj.weight",
        "mtp.layers.1.final_layernorm.weight": "model.layers.5.shared_head.norm.weight",
        "mtp.layers.0.transformer_layer.mlp.linear_fc2.weight": "model.layers.4.mlp.down_proj.weight",
        "mtp.layers.0.transformer_layer.input_layernorm.weight": "model.layers.4.input_layernorm.weight",
    }
    for name, logical in names.items():
        (got,) = megatron_logical_specs(
            TensorSpec(TensorMeta(name, (4,), torch.float32), rep, None), config, 0
        )
        assert got.meta.name == logical
    qkv = TensorSpec(TensorMeta("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight", (48, H),
                                torch.float32), rep, None)  # fmt: skip
    assert [s.meta.name for s in megatron_logical_specs(qkv, config, 0)][
        0
    ] == "model.layers.4.self_attn.q_proj.weight"
    no_layers = TensorSpec(TensorMeta("mtp.layers.0.enorm.weight", (4,), torch.float32), rep, None)
    assert megatron_logical_specs(no_layers, _config(), 0) is None  # N unknown: unmapped


@pytest.mark.parametrize(
    "name",
    [
        "embedding.position_embeddings.weight",
        "decoder.final_layernorm.bias",
        "decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "decoder.layers.0.mlp.shared_experts.gate_weight",
        "something.else",
    ],
)
def test_names_without_a_logical_tensor_are_unmapped(name):
    spec = TensorSpec(TensorMeta(name, (4, 4), torch.float32), _tp(1, Replicate()), None)
    assert megatron_logical_specs(spec, _config(num_layers=2), 0) is None


@pytest.mark.parametrize("tied", [False, True])
def test_a_padded_vocab_drops_its_padding_rows(tied):
    real, padded, tp = 100, 128, 2
    full = torch.randn(padded, H)
    layout = _tp(tp, Shard(0))
    config = _config(vocab_size=real, share_embeddings_and_output_weights=tied)
    for name, logical in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"),
    ):
        for rank in range(tp):
            spec = _spec(name, full, layout, rank)
            ((got, pad),) = megatron_logical_specs(spec, config, rank)
            assert got.meta.name == logical and got.meta.shape == (real, H)
            assert got.layout == _tp(tp, Shard(0, sizes=(64, 36)))
            assert torch.equal(got.tensor, full[64 * rank : min(64 * (rank + 1), real)])
            if rank == 0:
                assert pad is None
            else:
                assert torch.equal(pad, full[real:]) and pad.data_ptr() == spec.tensor[36:].data_ptr()
    unpadded = megatron_logical_specs(_spec("output_layer.weight", full, layout, 0), _config(), 0)
    assert unpadded[0].meta.shape == (padded, H) and unpadded[0].layout == layout  # no vocab_size: as is
    with pytest.raises(
        FormatError, match=r"^output_layer.weight has 128 rows, fewer than the real vocab_size=129"
    ):
        megatron_logical_specs(_spec("output_layer.weight", full, layout, 0), _config(vocab_size=129), 0)


def test_offline_layouts_equal_the_live_ones():
    """``map_offline`` (no tensors, no rank) gives the layouts every rank's live mapping gives."""
    tp, nh, ng = 2, 8, 4
    megatron = SimpleNamespace(
        num_attention_heads=nh, num_query_groups=ng, kv_channels=HEAD, hidden_size=32, gated_linear_unit=True,
        num_layers=2,
    )  # fmt: skip
    fmt = MegatronFormat(vocab_size=100, config=megatron)
    physical = [
        ("embedding.word_embeddings.weight", (128, H), Shard(0)),
        ("decoder.layers.1.self_attention.linear_qkv.weight", (ng * (nh // ng + 2) * HEAD, H), Shard(0)),
        ("decoder.layers.1.mlp.linear_fc1.weight", (16, H), Shard(0, stride=2)),
        ("decoder.layers.1.mlp.linear_fc2.weight", (H, 8), Shard(1)),
    ]
    for name, shape, placement in physical:
        layout = _tp(tp, placement)
        offline = fmt.map_offline(TensorSpec(TensorMeta(name, shape, torch.float32), layout, None))
        assert all(s.tensor is None for s in offline)
        for rank in range(tp):
            live = megatron_logical_specs(
                _spec(name, torch.zeros(shape), layout, rank),
                MegatronConfig.of(megatron, vocab_size=100),
                rank,
            )
            live = [s if isinstance(s, TensorSpec) else s[0] for s in live]
            assert [(s.meta, s.layout) for s in offline] == [(s.meta, s.layout) for s in live]
    with pytest.raises(FormatError, match="^format 'megatron': offline mapping needs config=$"):
        MegatronFormat().map_offline(TensorSpec(TensorMeta("output_layer.weight", (4, 4), torch.float32),
                                                _tp(1, Replicate()), None))  # fmt: skip


def test_config_from_a_transformer_config_and_refusals():
    megatron = pytest.importorskip("megatron.core.transformer.transformer_config")
    tc = megatron.TransformerConfig(
        num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, normalization="RMSNorm", rotary_interleaved=True, num_moe_experts=4,
        moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
    )  # fmt: skip
    config = MegatronConfig.of(tc, vocab_size=100, tied=True)
    assert config == MegatronConfig(8, 2, 8, True, True, 3, 100, rotary_interleaved=True, family="qwen2_moe")
    assert config.qkv_block == 6 * 8
    with pytest.raises(FormatError, match="num_attention_heads=6 is not a multiple of num_query_groups=4"):
        MegatronConfig.of(SimpleNamespace(num_attention_heads=6, num_query_groups=4, kv_channels=8))


REFUSED = [
    ("attention_output_gate", True, "attention_output_gate=True is not supported by format 'megatron': "
     "linear_qkv then holds per query group its query heads, their gates, k and v, which only Qwen3-Next "
     "(experimental_attention_variant='gated_delta_net') maps"),
    ("normalization", "LayerNorm", "normalization='LayerNorm' is not supported by format 'megatron': the HF "
     "families mapped here use RMSNorm, which has no biases"),
    ("softmax_type", "off-by-one", "softmax_type='off-by-one' is not supported by format 'megatron': the HF "
     "families mapped here use a plain softmax or GPT-OSS's learned sinks"),
    ("experimental_attention_variant", "dsa", "experimental_attention_variant='dsa' is not supported by "
     "format 'megatron': its sparse-attention indexer (DeepSeek-V3.2) is not mapped, and vLLM's CPU build "
     "cannot serve it"),
    ("heterogeneous_block_specs", True, "heterogeneous_block_specs=True is not supported by format "
     "'megatron': layers of different shapes or replaced blocks are not mapped"),
    ("layernorm_zero_centered_gamma", True, "layernorm_zero_centered_gamma=True is not supported by format "
     "'megatron': its norm weights are stored as w - 1; when the other side stores them so too (Gemma) "
     "pass MegatronFormat(norms_as_stored=True)"),
]  # fmt: skip


QWEN3_NEXT = dict(
    experimental_attention_variant="gated_delta_net", attention_output_gate=True,
    layernorm_zero_centered_gamma=True, moe_shared_expert_gate=True, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
)  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "family"),
    [
        ({"multi_latent_attention": True}, "deepseek_v3"),
        ({"softmax_type": "learnable"}, "gpt_oss"),
        ({"moe_shared_expert_gate": True}, "qwen2_moe"),
        ({"softmax_type": "vanilla"}, ""),
        (QWEN3_NEXT, "qwen3_next"),
    ],
    ids=["mla", "sinks", "gated-shared-expert", "llama-names", "gated-delta-net"],
)
def test_the_settings_only_a_family_uses_pick_its_names(settings, family):
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8, **settings)
    assert MegatronConfig.of(config).family == family


@pytest.mark.parametrize(("field", "value", "text"), REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_a_setting_with_no_mapping_is_refused_by_name(field, value, text):
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8, **{field: value})
    with pytest.raises(FormatError) as info:
        MegatronConfig.of(config)
    assert str(info.value) == text


@pytest.mark.parametrize(
    ("missing", "why"),
    [
        ("layernorm_zero_centered_gamma", "its norms are zero-centred (HF computes x·(1 + w)); build it with "
         "layernorm_zero_centered_gamma=True, as Megatron-Bridge does"),
        ("attention_output_gate", "its full-attention layers gate their output; build it with "
         "attention_output_gate=True"),
        ("linear_num_value_heads", "experimental_attention_variant='gated_delta_net' needs "
         "linear_num_value_heads"),
    ],
)  # fmt: skip
def test_a_qwen3_next_model_built_otherwise_than_its_checkpoint_is_refused_by_name(missing, why):
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8, **QWEN3_NEXT)
    setattr(config, missing, None if missing.startswith("linear") else False)
    with pytest.raises(FormatError) as info:
        MegatronConfig.of(config)
    assert str(info.value) == f"format 'megatron' cannot map this qwen3_next model: {why}"


def test_zero_centered_norms_move_as_stored_when_asked():
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8,
                             layernorm_zero_centered_gamma=True)  # fmt: skip
    assert MegatronConfig.of(config, norms_as_stored=True) == MegatronConfig(8, 2, 8, False)


class _DuckGPT(nn.Module):
    """Not Megatron's class, but shaped like a GPTModel: decoder, embedding, a TransformerConfig."""

    def __init__(self, config) -> None:
        super().__init__()
        self.decoder = nn.Linear(2, 2)
        self.embedding = nn.Embedding(4, 2)
        self.config = config


def test_detection_by_class_and_by_shape():
    tc_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    from megatron.core.models.gpt.gpt_model import GPTModel

    fmt = MegatronFormat()
    assert fmt.detect(GPTModel.__new__(GPTModel))  # the class decides; nothing is built
    tc = tc_module.TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm"
    )
    duck = _DuckGPT(tc)
    assert resolve_format(duck, None).name == "megatron"
    assert resolve_format([duck], None).name == "megatron"
    assert not fmt.detect(_DuckGPT(SimpleNamespace(num_layers=1)))
    assert not fmt.detect(nn.Linear(2, 2))
    config = fmt.config_of(duck)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (2, 2, 4)


MODEL_REFUSED = [
    ({"position_embedding_type": "learned_absolute"}, {}, "position_embedding_type='learned_absolute' is not "
     "supported by format 'megatron': its learned position embeddings (embedding.position_embeddings.weight) "
     "are not mapped"),
    ({"position_embedding_type": "none"}, {}, "position_embedding_type='none' is not supported by format "
     "'megatron': the HF families mapped here apply RoPE"),
    ({}, {"activation_func": torch.nn.functional.gelu, "gated_linear_unit": True},
     "activation_func='gelu' is not supported by format 'megatron': the gated MLPs of the HF families "
     "mapped here use SiLU (SwiGLU)"),
    ({}, {"activation_func": torch.nn.functional.silu, "gated_linear_unit": True,
          "softmax_type": "learnable"},
     "activation_func='silu' is not supported by format 'megatron': the gated MLPs of family 'gpt_oss' use "
     "quick_gelu with a clamp (GPT-OSS's SwiGLU)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "config", "text"), MODEL_REFUSED, ids=["learned", "nope", "gelu", "silu-in-gpt-oss"]
)
def test_a_model_setting_with_no_mapping_is_refused_by_name(model, config, text):
    duck = _DuckGPT(SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8, **config))
    for name, value in model.items():
        setattr(duck, name, value)
    with pytest.raises(FormatError) as info:
        MegatronFormat().config_of(duck)
    assert str(info.value) == text
    duck.config.activation_func = torch.nn.functional.silu
    duck.config.softmax_type = "vanilla"
    for name in model:
        delattr(duck, name)
    assert MegatronFormat().config_of(duck).num_query_groups == 2


def test_partial_rotary_adds_no_weight_and_is_mapped():
    """GLM-4.5 rotates the first half of each head, as Megatron's ``rotary_percent=0.5`` does."""
    duck = _DuckGPT(SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8))
    duck.rotary_percent = 0.5
    assert MegatronFormat().config_of(duck).kv_channels == 8


def test_qwen3_next_in_proj_offline_layouts_equal_the_live_ones_and_a_wrong_size_is_named():
    """Megatron's delta-net ``in_proj`` (rank r: ``[Q_r; K_r; V_r; Z_r; B_r; A_r]``) is the same two
    logical tensors, laid out alike, with and without tensors; a row count off the config is named."""
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=8, **QWEN3_NEXT)
    name = "decoder.layers.0.self_attention.in_proj.weight"
    rows = 2 * (2 * 8 + 4 * 8 + 4)  # nk·dk, nv·dv, nv, twice each
    layout = _tp(2, Shard(0))
    offline = MegatronFormat(config=config).map_offline(TensorSpec(TensorMeta(name, (rows, H), torch.float32),
                                                                   layout, None))  # fmt: skip
    assert [(s.meta.name, s.meta.shape) for s in offline] == [
        ("model.layers.0.linear_attn.in_proj_qkvz.weight", (2 * (2 * 8 + 2 * 2 * 8), H)),
        ("model.layers.0.linear_attn.in_proj_ba.weight", (8, H)),
    ]
    for rank in range(2):
        live = megatron_logical_specs(
            _spec(name, torch.zeros(rows, H), layout, rank), MegatronConfig.of(config), rank
        )
        assert [(s.meta, s.layout) for s in offline] == [(s.meta, s.layout) for s in live]
    wrong = TensorSpec(TensorMeta(name, (rows - 2, H), torch.float32), layout, None)
    with pytest.raises(FormatError) as info:
        MegatronFormat(config=config).map_offline(wrong)
    assert str(info.value) == (
        f"{name} has 102 rows: not [Q; K; V; Z; B; A] of 2 key heads of 8 and 4 value heads of 8 split "
        "evenly over TP"
    )
