"""``reshard plan --src-format/--dst-format``: offline plans across model formats, and what a
gather-first converter would move for the same pair."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from reshard_core.catalogue import CONFIGS, get_model
from reshard_core.cli import plan_cmd
from reshard_core.simulate.formats import format_table, gather_first_bytes
from reshard_core.simulate.parallel import parse_parallel


def app() -> typer.Typer:
    root = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    plan_cmd.register(root)

    @root.command("noop", hidden=True)
    def noop() -> None:  # a second command keeps "plan" a subcommand
        pass

    return root


def run(*args: str):
    return CliRunner().invoke(app(), ["plan", *args])


def test_hf_fsdp_to_vllm_moves_each_logical_element_once_and_a_quarter_of_gather_first():
    result = run(
        "--model", "llama3-8b", "--src", "fsdp=4", "--dst", "tp=4",
        "--src-format", "hf", "--dst-format", "vllm", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    model_bytes = get_model("llama3-8b").nbytes
    assert data["valid"] is True and data["formats"] == ["hf", "vllm"]
    norms = (2 * 32 + 1) * 4096 * 2  # 65 bf16 RMSNorm weights, held whole by each of the 4 TP ranks
    assert data["bytes_remote_total"] + data["bytes_local_total"] == model_bytes + 3 * norms
    assert data["shard_to_shard_bytes"] == model_bytes + 3 * norms  # the table's count: every rank
    assert data["gather_first_bytes"] == 4 * model_bytes  # every TP rank takes every tensor whole


def test_kv_replication_and_dp_replicas_in_the_table():
    config = CONFIGS["llama3-8b"]  # 8 kv heads: TP16 replicates each over 2 ranks
    table = format_table(config, parse_parallel("fsdp=16"), parse_parallel("tp=16"), "hf", "vllm")
    k = table["model.layers.0.self_attn.k_proj.weight"]
    assert [tuple(layout.mesh.shape) for layout in k.dst] == [(8, 2)]
    embed = table["model.embed_tokens.weight"]
    assert embed.meta.shape == (128256, 4096)  # logical: vLLM's 64-padding is not in it
    assert gather_first_bytes(table) == 16 * get_model("llama3-8b").nbytes


def test_format_errors_are_one_line():
    result = run("--model", "llama3-8b", "--src", "tp=2,pp=2", "--dst", "tp=4", "--src-format", "vllm")
    assert result.exit_code == 2
    assert "format 'vllm' takes tp, dp and ep only, not tp=2,pp=2" in result.output
    result = run("--model", "llama3-8b", "--src", "fsdp=4", "--dst", "tp=4", "--src-format", "nope")
    assert result.exit_code == 2
    assert "unknown format 'nope' for offline planning; use one of megatron, vllm, hf" in result.output


@pytest.mark.parametrize("model", ["llama3-8b"])
def test_json_shape_files_are_refused_for_formats(tmp_path, model):
    result = run(
        "--model", str(tmp_path / "x.json"), "--src", "fsdp=2", "--dst", "tp=2", "--dst-format", "vllm"
    )
    assert result.exit_code == 2


def test_megatron_to_vllm_with_kv_replication_beats_gather_first():
    # Megatron TP2 holds 4 of llama3-70b's 8 query groups per rank; vLLM TP16 replicates each kv
    # head over 2 ranks (the query-group check of --allow-uneven does not apply to vLLM's side)
    result = run(
        "--model", "llama3-70b", "--src", "tp=2", "--dst", "tp=16",
        "--src-format", "megatron", "--dst-format", "vllm", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["valid"] is True and data["formats"] == ["megatron", "vllm"]
    moved = data["bytes_remote_total"] + data["bytes_local_total"]
    assert data["gather_first_bytes"] == 16 * get_model("llama3-70b").nbytes
    assert data["gather_first_bytes"] > 15 * moved


def test_megatron_moe_to_hf_fsdp_and_a_model_vllm_cannot_hold():
    result = run(
        "--model", "tiny-gpt", "--src", "tp=2,dp=2,ep=2", "--dst", "fsdp=4", "--dst-format", "hf", "--json"
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["valid"] is True
    result = run("--model", "tiny-gpt", "--src", "tp=2,dp=2,ep=2", "--dst", "tp=2", "--dst-format", "vllm")
    assert result.exit_code == 2
    assert "tiny-gpt: an MoE model without q/k norms has no vLLM model type here (qwen3_moe)" in result.output


# logical tensors: embedding, final norm, head; per layer its attention's, two norms and its MLP's
MLA, DENSE = 7 + 2, 3  # q_a, q_a_layernorm, q_b, kv_a_proj_with_mqa, kv_a_layernorm, kv_b, o_proj
FULL_SIZE = [  # (model, source layout, destination layout, source format, extra flags, world, tensors)
    # DeepSeek-V3: 61 layers, 3 dense; MoE: router, its bias, 256 experts, a shared expert
    ("deepseek-v3", "tp=8,pp=8,ep=32,dp=32", "tp=8,ep=8,dp=8", "megatron", (), 2048,
     3 + 61 * MLA + 3 * DENSE + 58 * (2 + 256 * 3 + 3)),
    ("kimi-k2", "tp=8,pp=8,ep=32,dp=32", "tp=8,ep=8,dp=8", "megatron", (), 2048,
     3 + 61 * MLA + 1 * DENSE + 60 * (2 + 384 * 3 + 3)),
    # GLM-4.5: q/k/v weights and biases, o_proj, q/k norms; 3 dense layers; the router in fp32 in vLLM
    ("glm-4.5", "tp=8,pp=4,ep=16,dp=16", "tp=8,ep=4,dp=4", "megatron", ("--cast",), 512,
     3 + 92 * (9 + 2) + 3 * DENSE + 89 * (2 + 160 * 3 + 3)),
    # GPT-OSS: q/k/v/o weights and biases, sinks; router weight and bias; 128 experts with biases
    ("gpt-oss-120b", "tp=4,pp=2,ep=8,etp=1,dp=8", "tp=4,dp=2", "megatron", (), 64,
     3 + 36 * (9 + 2 + 2 + 128 * 6)),
    # Qwen3-Next: 36 delta-net layers (7 tensors), 12 gated attention layers (6), all MoE with a gated
    # shared expert; A_log in fp32 in vLLM
    ("qwen3-next-80b", "tp=2,pp=4,ep=8,dp=8", "tp=4,dp=2", "megatron", ("--cast",), 64,
     3 + 36 * 7 + 12 * 6 + 48 * (2 + 1 + 512 * 3 + 3 + 1)),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("model", "src", "dst", "fmt", "extra", "world", "tensors"), FULL_SIZE,
                         ids=[c[0] for c in FULL_SIZE])  # fmt: skip
def test_the_families_full_size_models_are_planned_into_vllm(model, src, dst, fmt, extra, world, tensors):
    """One spread rank and the busiest candidates are planned (each plan is what that rank computes)
    and every pair of them is checked."""
    result = run(
        "--model", model, "--src", src, "--dst", dst, "--src-format", fmt, "--dst-format", "vllm",
        "--sample", "1", "--json", *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["valid"] is True and data["formats"] == [fmt, "vllm"]
    assert (data["ranks"], data["tensors"]) == (world, tensors)
    assert data["gather_first_bytes"] > data["shard_to_shard_bytes"] >= data["model_bytes"] > 0
    assert data["ops_total"] > 0


def test_a_routers_dtype_is_named_with_the_flag_that_accepts_it():
    result = run("--model", "glm-4.5", "--src", "tp=8,pp=4,ep=16,dp=16", "--dst", "tp=8,ep=4,dp=4",
                 "--src-format", "megatron", "--dst-format", "vllm", "--sample", "1")  # fmt: skip
    assert result.exit_code == 1
    assert result.output.startswith(
        "error: 89 tensors differ only in dtype, source bfloat16 vs destination float32: "
        "model.layers.10.mlp.gate.weight, "
    )
    assert result.output.rstrip().endswith("; pass --cast to convert on the way (the sender converts)")


def test_qwen3_next_with_more_tp_ranks_than_query_groups_is_refused_naming_the_gated_heads():
    result = run("--model", "qwen3-next-80b", "--src", "tp=4", "--dst", "tp=4", "--dst-format", "vllm")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --dst-format: FormatError: decoder.layers.3.self_attention.linear_qkv.weight: "
        "a rank holding part of a query group (TP > query groups) splits its gated heads; keep TP ≤ "
        "num_query_groups"
    )
