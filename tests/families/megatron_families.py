"""Megatron-Core 0.16.1 ``GPTModel``s of the families on CPU (local layer spec), and an independent
converter from HF tensors to their parameters (no reshard code): the Megatron side of the families'
tests.

``build(kind, tp, ep)`` is collective over the world and builds the family's model with
``tiny.config(kind)``'s shapes, the way Megatron-Bridge configures it:

- ``deepseek_v3``: ``MLATransformerConfig`` (plain rope), q/kv layernorms, sigmoid router with its
  fp32 ``expert_bias``, shared experts, a dense first layer (``moe_layer_freq=[0, 1]``);
- ``glm4_moe``: q/k/v biases, q/k layernorms, ``rotary_percent=0.5``, DeepSeek-V3's MoE;
- ``gpt_oss``: ``softmax_type="learnable"`` (sinks), biases everywhere, ``quick_gelu`` with
  ``glu_linear_offset=1`` and a ±7 clamp (unfused: Megatron's fused path clamps before adding the fc1
  bias), sliding windows on odd layers, expert TP 1 (Megatron's MoE biases need it);
- ``qwen2_moe``: q/k/v biases, a softmax router, one shared expert with its sigmoid gate;
- ``qwen3_next``: gated delta-net layers (``experimental_attention_variant="gated_delta_net"``) and
  full-attention layers with output gates and q/k layernorms, zero-centred norms, Qwen2-MoE's MoE,
  ``rotary_percent=0.25``; float32 (``tiny.FLOAT32``).

Megatron 0.16.1 builds none of these on CPU as shipped. ``cpu_stand_ins`` installs what makes them
run; none touches a weight:

- ``torch.cuda.current_device`` → "cpu", the CUDA RNG tracker's ``fork`` → a null context (as every
  Megatron test here does), MoE's ``te_general_gemm`` → None (referenced without Transformer Engine);
- ``MLACoreAttentionStandIn``: Megatron's local ``DotProductAttention`` with MLA's separate key and
  value head sizes (it rejects the ``k_channels`` / ``v_channels`` MLA passes), and
  ``multi_latent_attention.HAVE_TE = False`` (without TE it holds mock classes, which ``isinstance``
  rejects);
- ``cpu_sliding_window_mask``: the sliding-window causal mask Megatron builds on "cuda", built on CPU;
- Qwen3-Next (``qwen3_next_stand_ins``): Megatron builds it only from Transformer Engine's spec
  and runs flash-linear-attention's kernels. ``qwen3_next_spec`` assembles the same layers from
  Megatron's local modules with ``ZeroCenteredRMSNormStandIn`` (TE's ``zero_centered_gamma`` RMSNorm:
  ``x / rms(x) · (1 + w)``), and the delta rule runs Megatron's own torch implementation
  (``torch_chunk_gated_delta_rule``) with an L2 norm written out (``l2norm_stand_in``); torch.compile
  (Megatron's ``jit_fuser`` on the gated norms) is off.

MLA's local spec gathers its down projections over the *global* TP group, so ``init_parallel_state``
sets Megatron's global state to the model's TP and EP sizes.

``expected(model, logical, kind)`` gives every parameter and persistent buffer of a model on this
rank, converted from ``logical`` (HF checkpoint tensors, per expert: ``logical_of``), from
docs/formats.md and the families' files' tables.
"""

from __future__ import annotations

import contextlib
from typing import Any

import tiny
import torch

# ------------------------------------------------------------------ CPU stand-ins


def cpu_stand_ins() -> None:
    """Let the families' Megatron models build and run forward on CPU (see the module docstring)."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    mla.HAVE_TE = False
    fused_softmax.get_sliding_window_causal_mask = cpu_sliding_window_mask


def cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """Megatron's ``get_sliding_window_causal_mask`` (True: masked), built on CPU."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    keep = torch.tril(
        torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1]
    )
    return ~keep


def mla_core_attention_stand_in() -> type:
    """``DotProductAttention`` accepting MLA's ``k_channels`` / ``v_channels`` (its forward reads the
    head size only to shape its output, which is ``v_channels`` per head)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLACoreAttentionStandIn(DotProductAttention):
        def __init__(
            self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kw: Any
        ):
            super().__init__(*args, **kw)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLACoreAttentionStandIn


class ZeroCenteredRMSNormStandIn(torch.nn.Module):
    """Transformer Engine's RMSNorm with ``zero_centered_gamma``: ``x / rms(x) · (1 + w)``, ``w`` from 0."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def l2norm_stand_in(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's ``l2norm`` over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def qwen3_next_stand_ins() -> None:
    """Let Megatron's ``GatedDeltaNet`` build and run on CPU without flash-linear-attention."""
    import megatron.core.ssm.gated_delta_net as gdn
    import torch._dynamo

    torch._dynamo.config.disable = True
    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm_stand_in
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule


def qwen3_next_spec(config: Any) -> Any:
    """Qwen3-Next's decoder block from Megatron's local modules (its own spec needs Transformer
    Engine): delta-net layers where ``linear_attention_freq`` says, norms zero-centred."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = ZeroCenteredRMSNormStandIn
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    layers = []
    for n, layer in enumerate(block.layer_specs):
        layer = copy.deepcopy(layer)
        sub = layer.submodules
        sub.input_layernorm, sub.pre_mlp_layernorm = norm, norm
        if config.linear_attention_freq[n]:
            sub.self_attention = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear))  # fmt: skip
        else:
            sub.self_attention.submodules.q_layernorm = norm
            sub.self_attention.submodules.k_layernorm = norm
        layers.append(layer)
    block.layer_specs, block.layer_norm = layers, norm
    return block


def init_parallel_state(tp: int, ep: int, etp: int | None = None) -> None:
    """Megatron's global parallel state at the model's sizes (MLA's local spec gathers over it)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )


# ------------------------------------------------------------------ models


def build(kind: str, tp: int, ep: int) -> Any:
    """The family's ``GPTModel`` at TP ``tp``, EP ``ep`` over the world (collective), eval mode,
    parameters as Megatron initialised them."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from reshard_core.testing.models import build_pg_collection

    c = config_of(kind)
    etp = 1 if kind == "gpt_oss" else None
    init_parallel_state(tp, ep, etp)
    config, options = _CONFIGS[kind](c, tp, ep, etp)
    if kind == "qwen3_next":
        qwen3_next_stand_ins()
        spec = qwen3_next_spec(config)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if kind == "deepseek_v3":
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = mla_core_attention_stand_in()
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=c.vocab_size, max_sequence_length=16,
        share_embeddings_and_output_weights=False, pg_collection=build_pg_collection(tp=tp, ep=ep, etp=etp),
        position_embedding_type="rope", rotary_base=10000, **options,
    )  # fmt: skip
    return model.eval()


def _common(c: Any, tp: int, ep: int, etp: int | None) -> dict[str, Any]:
    return dict(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, gated_linear_unit=True,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        hidden_dropout=0.0, attention_dropout=0.0, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_topk=c.num_experts_per_tok,
    )  # fmt: skip


def _sigmoid_moe(c: Any) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's MoE: sigmoid scores with an fp32 expert bias, shared experts."""
    return dict(
        num_moe_experts=c.n_routed_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=c.routed_scaling_factor, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
        moe_layer_freq=[int(n >= c.first_k_dense_replace) for n in range(c.num_hidden_layers)],
        ffn_hidden_size=c.intermediate_size,
    )  # fmt: skip


def _deepseek_v3(c: Any, tp: int, ep: int, etp: int | None) -> tuple[Any, dict]:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(**_common(c, tp, ep, etp), **_sigmoid_moe(c), activation_func=F.silu,
        q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
        qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope_type="rope", rotary_base=10000,
        qk_layernorm=True, add_bias_linear=False)  # fmt: skip
    return config, {}


def _glm4_moe(c: Any, tp: int, ep: int, etp: int | None) -> tuple[Any, dict]:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**_common(c, tp, ep, etp), **_sigmoid_moe(c), activation_func=F.silu,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim, add_qkv_bias=True,
        add_bias_linear=False, qk_layernorm=True)  # fmt: skip
    return config, {"rotary_percent": c.rope_parameters["partial_rotary_factor"]}


def _gpt_oss(c: Any, tp: int, ep: int, etp: int | None) -> tuple[Any, dict]:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**_common(c, tp, ep, etp), num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size, add_bias_linear=True,
        activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=c.swiglu_limit,
        bias_activation_fusion=False, softmax_type="learnable", window_size=(c.sliding_window - 1, 0),
        window_attn_skip_freq=2, num_moe_experts=c.num_local_experts, moe_ffn_hidden_size=c.intermediate_size,
        moe_router_pre_softmax=False)  # fmt: skip
    return config, {}


def _qwen2_moe(c: Any, tp: int, ep: int, etp: int | None) -> tuple[Any, dict]:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**_common(c, tp, ep, etp), activation_func=F.silu,
        num_query_groups=c.num_key_value_heads, kv_channels=c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size, add_qkv_bias=True, add_bias_linear=False,
        num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        moe_shared_expert_gate=True)  # fmt: skip
    return config, {}


def _qwen3_next(c: Any, tp: int, ep: int, etp: int | None) -> tuple[Any, dict]:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    linear = [int(kind == "linear_attention") for kind in c.layer_types]
    config = TransformerConfig(**_common(c, tp, ep, etp), activation_func=F.silu,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        add_bias_linear=False, qk_layernorm=True, attention_output_gate=True,
        layernorm_zero_centered_gamma=True, num_moe_experts=c.num_experts,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size, moe_shared_expert_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=linear,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads)  # fmt: skip
    return config, {"rotary_percent": c.rope_parameters["partial_rotary_factor"]}


_CONFIGS = {
    "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss, "qwen2_moe": _qwen2_moe,
    "qwen3_next": _qwen3_next,
}  # fmt: skip


def config_of(kind: str) -> Any:
    """The transformers config the family's Megatron model is built like (Qwen3-Next in float32:
    Megatron's parameters are, and logits are compared)."""
    return tiny.config(kind, dtype="float32") if kind == "qwen3_next" else tiny.config(kind)
KINDS = tuple(_CONFIGS)


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Megatron's forward of ``ids`` (causal), logits over the whole vocabulary on every TP rank."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        out = model(ids, torch.arange(s).expand_as(ids), mask)
    return gather_from_tensor_model_parallel_region(out, group=model.pg_collection.tp)


def weights(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of a Megatron model (the router's ``expert_bias`` is one)."""
    return dict(model.named_parameters()) | {
        n: b for n, b in model.named_buffers() if n.endswith("expert_bias")
    }


# ------------------------------------------------------------------ the converter


def logical_of(hf: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """HF tensors as transformers 5 holds them → HF checkpoint (logical) tensors, per expert: fused
    ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``; GPT-OSS's input-major
    ``gate_up_proj [E, H, 2I]`` (gate the even columns), ``down_proj [E, I, H]`` and their biases."""
    out = {}
    for name, t in hf.items():
        prefix, _, last = name.rpartition(".experts.")
        where = f"{prefix}.experts."
        experts = range(t.shape[0]) if prefix else ()
        if kind == "gpt_oss" and last in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            for e in experts:
                if last == "gate_up_proj":
                    out[f"{where}{e}.gate_proj.weight"] = t[e, :, 0::2].t()
                    out[f"{where}{e}.up_proj.weight"] = t[e, :, 1::2].t()
                elif last == "gate_up_proj_bias":
                    out[f"{where}{e}.gate_proj.bias"], out[f"{where}{e}.up_proj.bias"] = (
                        t[e, 0::2],
                        t[e, 1::2],
                    )
                elif last == "down_proj":
                    out[f"{where}{e}.down_proj.weight"] = t[e].t()
                else:
                    out[f"{where}{e}.down_proj.bias"] = t[e]
        elif last == "gate_up_proj":
            for e in experts:
                gate, up = t[e].chunk(2)
                out[f"{where}{e}.gate_proj.weight"], out[f"{where}{e}.up_proj.weight"] = gate, up
        elif last == "down_proj" and t.dim() == 3:
            for e in experts:
                out[f"{where}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def expected(model: Any, logical: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """What every tensor of ``weights(model)`` on this rank holds when converted from ``logical``."""
    pgs = model.pg_collection
    tp, s = pgs.tp.size(), pgs.tp.rank()
    etp, es = pgs.expt_tp.size(), pgs.expt_tp.rank()
    return {name: _tensor(model, name, logical, kind, (tp, s), (etp, es)) for name in weights(model)}


def _tensor(model: Any, name: str, logical: dict, kind: str, at: tuple[int, int], expert_at: tuple[int, int]):
    tp, s = at
    rows = lambda t, w=tp, i=s: t.chunk(w)[i]  # noqa: E731
    cols = lambda t, w=tp, i=s: t.chunk(w, dim=1)[i]  # noqa: E731
    top = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in top:
        return rows(logical[top[name]])
    if name == "decoder.final_layernorm.weight":
        return logical["model.norm.weight"]
    _, _, k, what = name.split(".", 3)
    layer = model.decoder.layers[int(k)]
    hf = f"model.layers.{layer.layer_number - 1}."
    c = config_of(kind)
    if kind == "qwen3_next" and c.layer_types[layer.layer_number - 1] == "linear_attention":
        if what.startswith("self_attention."):
            return _delta_net(what, logical, f"{hf}linear_attn.", c, at)
    if kind == "qwen3_next" and what == "self_attention.linear_qkv.weight":
        return rows(_gated_qkv(logical, f"{hf}self_attn.", c))
    if what.startswith("self_attention.linear_qkv."):
        kind_ = what.rsplit(".", 1)[1]
        heads, groups = c.num_attention_heads, c.num_key_value_heads
        h = getattr(c, "head_dim", None) or c.hidden_size // heads
        p = heads // groups
        q, key, v = (logical[f"{hf}self_attn.{x}_proj.{kind_}"] for x in "qkv")
        blocks = []
        for g in range(groups):  # group g: its p query heads, then k_g, then v_g
            blocks += [q[g * p * h : (g + 1) * p * h], key[g * h : (g + 1) * h], v[g * h : (g + 1) * h]]
        return rows(torch.cat(blocks))
    if what.startswith("mlp.experts.local_experts."):
        _, _, _, j, fc, part = what.split(".")
        e = layer.mlp.local_expert_indices[int(j)]
        etp, es = expert_at
        expert = f"{hf}mlp.experts.{e}."
        if fc == "linear_fc1":
            return torch.cat([logical[f"{expert}{x}_proj.{part}"].chunk(etp)[es] for x in ("gate", "up")])
        return logical[f"{expert}down_proj.weight"].chunk(etp, dim=1)[es] if part == "weight" else logical[
            f"{expert}down_proj.bias"]  # fmt: skip
    one_gated = kind in ("qwen2_moe", "qwen3_next")
    shared = "mlp.shared_expert." if one_gated else "mlp.shared_experts."  # one gated, or several
    for fc1, where in (("mlp.linear_fc1.", "mlp."), ("mlp.shared_experts.linear_fc1.", shared)):
        if what.startswith(fc1):
            part = what.rsplit(".", 1)[1]
            return torch.cat([rows(logical[f"{hf}{where}{x}_proj.{part}"]) for x in ("gate", "up")])
    mla = {"q_layernorm": "q_a_layernorm", "kv_layernorm": "kv_a_layernorm"}
    norms = mla if kind == "deepseek_v3" else {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}
    router = "mlp.router" if kind == "gpt_oss" else "mlp.gate"
    table = {  # Megatron name in a layer → (how this rank holds it, HF name in the layer)
        "input_layernorm.weight": (None, "input_layernorm.weight"),
        "pre_mlp_layernorm.weight": (None, "post_attention_layernorm.weight"),
        "self_attention.linear_proj.weight": (cols, "self_attn.o_proj.weight"),
        "self_attention.linear_proj.bias": (None, "self_attn.o_proj.bias"),
        "self_attention.linear_q_down_proj.weight": (rows, "self_attn.q_a_proj.weight"),
        "self_attention.linear_kv_down_proj.weight": (rows, "self_attn.kv_a_proj_with_mqa.weight"),
        "self_attention.linear_q_up_proj.weight": (rows, "self_attn.q_b_proj.weight"),
        "self_attention.linear_kv_up_proj.weight": (rows, "self_attn.kv_b_proj.weight"),
        "self_attention.core_attention.softmax_offset": (rows, "self_attn.sinks"),
        "mlp.linear_fc2.weight": (cols, "mlp.down_proj.weight"),
        "mlp.shared_experts.linear_fc2.weight": (cols, f"{shared}down_proj.weight"),
        "mlp.shared_experts.gate_weight": (None, "mlp.shared_expert_gate.weight"),
        "mlp.router.weight": (None, f"{router}.weight"),
        "mlp.router.bias": (None, "mlp.router.bias"),
        "mlp.router.expert_bias": (None, "mlp.gate.e_score_correction_bias"),
        **{f"self_attention.{m}.weight": (None, f"self_attn.{n}.weight") for m, n in norms.items()},
    }
    cut, key = table[what]
    return cut(logical[hf + key]) if cut else logical[hf + key]


def _gated_qkv(logical: dict, a: str, c: Any) -> torch.Tensor:
    """Megatron's whole ``linear_qkv`` with output gates: per query group its query heads, their
    gates, k and v; HF's ``q_proj`` holds per head its query rows, then its gate rows."""
    heads, groups, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    p = heads // groups
    q = logical[f"{a}q_proj.weight"].view(heads, 2, h, -1)
    k, v = logical[f"{a}k_proj.weight"], logical[f"{a}v_proj.weight"]
    blocks = []
    for g in range(groups):
        mine = q[g * p : (g + 1) * p]
        blocks += [mine[:, 0].reshape(p * h, -1), mine[:, 1].reshape(p * h, -1)]
        blocks += [k[g * h : (g + 1) * h], v[g * h : (g + 1) * h]]
    return torch.cat(blocks)


def _delta_net(what: str, logical: dict, a: str, c: Any, at: tuple[int, int]) -> torch.Tensor:
    """A Megatron ``GatedDeltaNet`` parameter on TP rank ``at[1]`` of ``at[0]`` from HF's linear_attn."""
    tp, s = at
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, per = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    mine = list(range(s * nk // tp, (s + 1) * nk // tp))
    if what == "self_attention.in_proj.weight":  # rank s: [Q_s; K_s; V_s; Z_s; B_s; A_s]
        qkvz = logical[f"{a}in_proj_qkvz.weight"].view(nk, 2 * dk + 2 * per * dv, -1)[mine]
        ba = logical[f"{a}in_proj_ba.weight"].view(nk, 2 * per, -1)[mine]
        parts = [*qkvz.split([dk, dk, per * dv, per * dv], dim=1), *ba.split([per, per], dim=1)]
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in parts])
    if what == "self_attention.conv1d.weight":  # channels [Q | K | V], each split over TP
        parts = logical[f"{a}conv1d.weight"].split([nk * dk, nk * dk, nv * dv])
        return torch.cat([t.chunk(tp)[s] for t in parts])
    if what == "self_attention.out_norm.weight":  # zero-centred in Megatron, x·w in HF
        return logical[f"{a}norm.weight"] - 1
    if what == "self_attention.out_proj.weight":
        return logical[f"{a}out_proj.weight"].chunk(tp, dim=1)[s]
    return logical[f"{a}{what.removeprefix('self_attention.')}"].chunk(tp)[s]  # dt_bias, A_log
