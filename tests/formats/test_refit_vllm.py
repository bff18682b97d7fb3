"""HF (FSDP2) → vLLM's convention, in one 4-rank Gloo world, every destination element checked.

- transformers ``LlamaForCausalLM`` (nh=8, ng=2, vocab 99: FSDP2 shards the vocab 25/25/25/24) under
  ``fully_shard`` → the vLLM stand-in at TP4 (kv heads replicated over 2 ranks) and TP2×DP2, with
  ``refit(src, dst)`` and no format arguments: bit for bit against ``vllm_oracle`` (docs/formats.md's
  formulas), padding rows zero (they held NaN), and each rank receives exactly the bytes of its
  real destination elements it does not copy locally.
- ``Qwen3MoeForCausalLM`` (6 experts, tied embeddings, layer 1 dense; FSDP2 splits the experts
  2/2/2/0) → EP over 4 ranks ("linear": 2, 2, 1, 1), expert TP over DP2×TP2 (M=4), and EP
  "round_robin" over DP2×TP2.
- Back: the stand-in (TP4; EP4) → a fresh FSDP2 model, exact, its NaN padding rows never read.
- A third-party format registered in-process (``register_plugin``): an engine keeping every matrix
  transposed and column-sharded, mapped with ``pieces.permute``, detected, refit exactly from HF.
- Bad input, each one ``PlanError`` on every rank with the destination untouched: a parameter the
  format does not know; logical names the source lacks (all listed, counted); a format giving two
  views of one rank for one logical name; a format leaving part of a fused parameter unmapped.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from vllm_oracle import expected_vllm, hf_values

from reshard_core.errors import PlanError
from reshard_core.formats import ModelFormat
from reshard_core.formats.pieces import permute, rename
from reshard_core.formats.vllm import VLLMFormat
from reshard_core.hookspecs import hookimpl
from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

WORLD = 4
TP4 = [(0, 1, 2, 3)]
TP2_DP2 = [(0, 1), (2, 3)]


def llama_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=99, hidden_size=40, intermediate_size=44, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=6, tie_word_embeddings=False, **extra,
    )  # fmt: skip


def moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=99, hidden_size=32, intermediate_size=24, moe_intermediate_size=12, num_experts=6,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=6, mlp_only_layers=[1], tie_word_embeddings=True,
    )  # fmt: skip


def fsdp_model(config, seed: int):
    """The transformers model for ``config`` with telling values, under FSDP2 over the world; and
    its full tensors before sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    full = hf_values(model, seed)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, full


def standin(config, groups, rank, **parallel):
    from reshard_core.formats.vllm import VLLMParallel
    from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM

    return VLLMStandInForCausalLM(config, VLLMParallel(tuple(groups), **parallel), rank)


def _refit_case(src, full, config, groups, rank, **options) -> dict:
    """Refit ``src`` into a fresh stand-in; the facts the tests check."""
    import reshard_core

    ep, placement = options.get("enable_expert_parallel", False), options.get("expert_placement", "linear")
    dst = standin(config, groups, rank, **options)
    held = dict(dst.named_parameters())
    expected, padding = expected_vllm(full, config, groups, rank, ep=ep, placement=placement)
    report = reshard_core.refit(src, dst)
    real_bytes = (sum(t.numel() for t in held.values()) - padding) * 4
    return {
        "names": sorted(held) == sorted(expected),
        "wrong": sorted(n for n in expected if not torch.equal(held[n], expected[n])),
        "shapes": {n: tuple(t.shape) for n, t in held.items() if "qkv" in n or "w13" in n or "embed" in n},
        "padding": padding,
        "bytes": (report.bytes_received, report.bytes_local, real_bytes),
        "formats": _formats(src, dst),
    }


def _reverse_case(full, config, groups, rank, **options) -> dict:
    """The stand-in holding the oracle's values (padding rows NaN, which must never be read) → a
    fresh FSDP2 transformers model: every full tensor equals the HF original."""
    import reshard_core

    src = standin(config, groups, rank, **options)
    values, _ = expected_vllm(
        full,
        config,
        groups,
        rank,
        ep=src.reshard_vllm_parallel.use_ep,
        placement=src.reshard_vllm_parallel.expert_placement,
    )
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.copy_(values[name])
            if "embed_tokens" in name or "lm_head" in name:
                p[(values[name] == 0).all(dim=1)] = math.nan  # padding rows
    dst, _ = fsdp_model(config, seed=9)
    reshard_core.refit(src, dst)
    got = {n: p.full_tensor() for n, p in dst.named_parameters()}
    return {
        "wrong": sorted(n for n in full if not torch.equal(got[n], full[n])),
        "formats": _formats(src, dst),
    }


def _formats(src, dst) -> tuple[str, str]:
    from reshard_core.formats import resolve_format

    return resolve_format(src, None).name, resolve_format(dst, None).name


# ---------------------------------------------------------------- a third-party format


class TransposedEngine(nn.Module):
    """A custom engine: every matrix kept as ``W.T`` with its output dim split over the ranks."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], rank: int) -> None:
        from reshard_core.extract import declare_layout

        super().__init__()
        self.weights = nn.ParameterDict()
        for name, shape in shapes.items():
            key = name.replace(".", "__")
            if len(shape) == 2:
                rows = _chunk(shape[0], rank)
                param = nn.Parameter(torch.full((shape[1], rows[1] - rows[0]), math.nan), requires_grad=False)
                declare_layout(param, dim=1, ranks=range(WORLD), shape=(shape[1], shape[0]))
                self.weights[key + "__T"] = param
            else:
                self.weights[key] = nn.Parameter(torch.full(shape, math.nan), requires_grad=False)


def _chunk(n: int, rank: int) -> tuple[int, int]:
    size = -(-n // WORLD)
    return min(n, rank * size), min(n, (rank + 1) * size)


class TransposedFormat(ModelFormat):
    name = "transposed-engine"
    description = "a custom engine storing W.T"

    def detect(self, model) -> bool:
        return isinstance(model, TransposedEngine)

    def map_spec(self, spec, model, context):
        key = spec.meta.name.removeprefix("weights.")
        if key.endswith("__T"):
            return [permute(spec, (1, 0), key[: -len("__T")].replace("__", "."))]
        return [rename(spec, key.replace("__", "."))]


class _Provider:
    @hookimpl
    def reshard_formats(self):
        return [TransposedFormat()]


def _plugin_case(src, full, rank: int) -> dict:
    import reshard_core
    from reshard_core.plugins import register_plugin

    register_plugin(_Provider(), name="transposed-engine-plugin")
    dst = TransposedEngine({n: tuple(t.shape) for n, t in full.items()}, rank)
    reshard_core.refit(src, dst)
    wrong = []
    for name, t in full.items():
        key = name.replace(".", "__")
        if t.dim() == 2:
            a, b = _chunk(t.shape[0], rank)
            ok = torch.equal(dst.weights[key + "__T"], t.T[:, a:b])
        else:
            ok = torch.equal(dst.weights[key], t)
        if not ok:
            wrong.append(name)
    return {"wrong": wrong, "formats": _formats(src, dst), "count": len(full)}


# ---------------------------------------------------------------- bad input


class DoubledFormat(VLLMFormat):
    """Gives every ``o_proj`` twice (two views of one rank for one logical name)."""

    name = "vllm-doubled"

    def logical_specs(self, model, side, context):
        out = super().logical_specs(model, side, context)
        out.specs += [s for s in out.specs if s.meta.name.endswith("o_proj.weight")]
        return out


class HoleyFormat(VLLMFormat):
    """Forgets ``v_proj``'s rows of every ``qkv_proj`` (and so leaves them unwritten)."""

    name = "vllm-holey"

    def logical_specs(self, model, side, context):
        out = super().logical_specs(model, side, context)
        out.specs = [s for s in out.specs if not s.meta.name.endswith("v_proj.weight")]
        return out


def _error(call) -> str | None:
    try:
        call()
    except PlanError as exc:
        return str(exc)
    return None


def _untouched(model) -> bool:
    return all(bool(p.isnan().all()) for p in model.parameters())


def _bad_cases(src, rank: int) -> dict:
    import reshard_core

    out = {}
    dst = standin(llama_config(), TP4, rank)
    dst.model.layers[1].mlp.register_parameter("scale", nn.Parameter(torch.full((4,), math.nan)))
    out["unknown"] = (_error(lambda: reshard_core.refit(src, dst)), _untouched(dst))
    dst = standin(llama_config(attention_bias=True), TP4, rank)
    out["dst_only"] = (_error(lambda: reshard_core.refit(src, dst)), _untouched(dst))
    dst = standin(llama_config(), TP4, rank)
    for case, fmt in (("doubled", DoubledFormat()), ("holey", HoleyFormat())):
        out[case] = (_error(lambda fmt=fmt: reshard_core.refit(src, dst, dst_format=fmt)), _untouched(dst))
    return out


def _world(rank: int, world: int) -> dict:
    import reshard_core

    out = {}
    llama = llama_config()
    src, full = fsdp_model(llama, seed=1)
    out["llama"] = {
        "tp4": _refit_case(src, full, llama, TP4, rank),
        "tp2xdp2": _refit_case(src, full, llama, TP2_DP2, rank),
        "src_rows": src.model.embed_tokens.weight.to_local().shape[0],
        "reverse": _reverse_case(full, llama, TP4, rank),
    }
    out["bad"] = _bad_cases(src, rank)
    out["plugin"] = _plugin_case(src, full, rank)
    moe = moe_config()
    src, full = fsdp_model(moe, seed=2)
    out["moe"] = {
        "ep4": _refit_case(src, full, moe, TP4, rank, enable_expert_parallel=True),
        "expert_tp": _refit_case(src, full, moe, TP2_DP2, rank),
        "ep_round_robin": _refit_case(
            src, full, moe, TP2_DP2, rank, enable_expert_parallel=True, expert_placement="round_robin"
        ),
        "src_experts": src.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0],
        "reverse": _reverse_case(full, moe, TP4, rank, enable_expert_parallel=True),
    }
    reshard_core.clear_caches()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, WORLD, timeout=300, pg_timeout=120)


def _check(results, family: str, case: str) -> None:
    for rank in range(WORLD):
        facts = results[rank][family][case]
        assert facts["formats"] == ("hf", "vllm")  # detected: refit(src, dst) took no format argument
        assert facts["names"]
        assert facts["wrong"] == []
        received, local, real = facts["bytes"]
        assert received <= real - local  # only the slices this rank needs move to it
        assert received == real - local  # ...each once: every real element is received or copied


@pytest.mark.parametrize("case", ["tp4", "tp2xdp2"])
def test_fsdp2_llama_to_vllm_tp_is_exact_and_moves_only_needed_slices(results, case):
    _check(results, "llama", case)
    assert [results[r]["llama"]["src_rows"] for r in range(WORLD)] == [25, 25, 25, 24]  # uneven FSDP2
    shapes = [results[r]["llama"][case]["shapes"] for r in range(WORLD)]
    if case == "tp4":  # 2 q heads + one kv head (replicated over 2 ranks) of 6 rows; 128/4 vocab rows
        assert all(s["model.layers.0.self_attn.qkv_proj.weight"] == (24, 40) for s in shapes)
        assert all(s["model.embed_tokens.weight"] == (32, 40) for s in shapes)
        assert [results[r]["llama"][case]["padding"] for r in range(WORLD)] == [0, 0, 0, 2 * 29 * 40]
    else:  # 4 q heads + 1 kv head each
        assert all(s["model.layers.0.self_attn.qkv_proj.weight"] == (36, 40) for s in shapes)
        assert [results[r]["llama"][case]["padding"] for r in range(WORLD)] == [0, 2 * 29 * 40] * 2


@pytest.mark.parametrize("case", ["ep4", "expert_tp", "ep_round_robin"])
def test_fsdp2_qwen3_moe_to_vllm_experts_is_exact(results, case):
    _check(results, "moe", case)
    assert [results[r]["moe"]["src_experts"] for r in range(WORLD)] == [2, 2, 2, 0]  # uneven FSDP2
    w13 = [results[r]["moe"][case]["shapes"]["model.layers.0.mlp.experts.w13_weight"] for r in range(WORLD)]
    expected = {
        "ep4": [(2, 24, 32), (2, 24, 32), (1, 24, 32), (1, 24, 32)],  # linear: 2, 2, 1, 1
        "expert_tp": [(6, 6, 32)] * 4,  # I = 12 over M = DP2 × TP2
        "ep_round_robin": [(2, 24, 32), (2, 24, 32), (1, 24, 32), (1, 24, 32)],
    }
    assert w13 == expected[case]


@pytest.mark.parametrize("family", ["llama", "moe"])
def test_vllm_convention_back_to_fsdp2_is_exact_and_never_reads_padding(results, family):
    for rank in range(WORLD):
        assert results[rank][family]["reverse"] == {"wrong": [], "formats": ("vllm", "hf")}


def test_a_third_party_format_registered_in_process_refits_exactly(results):
    for rank in range(WORLD):
        facts = results[rank]["plugin"]
        assert facts["formats"] == ("hf", "transposed-engine")
        assert facts["count"] == 21 and facts["wrong"] == []


def test_a_parameter_the_format_does_not_know_is_one_error_on_every_rank(results):
    for rank in range(WORLD):
        assert results[rank]["bad"]["unknown"] == (
            "1 destination tensor of format 'vllm' map to no logical tensor: model.layers.1.mlp.scale "
            "(ranks [0-3]); pass ignore= with their names to leave them out",
            True,
        )


def test_logical_names_the_source_lacks_are_all_listed_and_counted(results):
    names = ", ".join(
        f"model.layers.{n}.self_attn.{p}_proj.bias" for n in range(2) for p in ("k", "o", "q", "v")
    )
    for rank in range(WORLD):
        assert results[rank]["bad"]["dst_only"] == (
            f"8 tensors on the destination only (ranks [0-3]), no source holds them: {names}; pass ignore= "
            "with their names to leave them out, or tied= to feed them from other tensors",
            True,  # the destination, padding rows included, still holds its NaNs
        )


def test_a_format_giving_one_logical_tensor_twice_is_one_error_listing_them(results):
    o_proj = [f"model.layers.{n}.self_attn.o_proj.weight" for n in range(2)]
    for rank in range(WORLD):
        assert results[rank]["bad"]["doubled"] == (
            "ranks [0-3]: format 'vllm-doubled' gives 2 destination logical tensors twice: "
            f"{', '.join(o_proj)}; "
            "ranks [0-3]: format 'vllm-doubled' maps parts of 2 destination tensors more than once: "
            f"{o_proj[0]} (480 elements more than it holds), {o_proj[1]} (480 elements more than it holds)",
            True,
        )


def test_a_format_leaving_part_of_a_fused_parameter_unmapped_is_one_error(results):
    qkv = [f"model.layers.{n}.self_attn.qkv_proj.weight" for n in range(2)]
    for rank in range(WORLD):
        assert results[rank]["bad"]["holey"] == (
            "ranks [0-3]: format 'vllm-holey' leaves 2 destination tensors partly unwritten: "
            f"{qkv[0]} (240 of 960 elements), {qkv[1]} (240 of 960 elements); "
            "map those elements or return them as padding",
            True,
        )


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
