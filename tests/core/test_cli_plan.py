"""``reshard plan`` through typer's CliRunner: text and JSON output, exit codes, one-line errors."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from reshard_core.cli import plan_cmd

KEYS = {
    "ranks",
    "metadata_bytes",
    "plan_seconds_max",
    "bytes_remote_total",
    "bytes_local_total",
    "messages_total",
    "valid",
}


def app() -> typer.Typer:
    root = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    plan_cmd.register(root)

    @root.command("noop", hidden=True)
    def noop() -> None:  # a second command keeps "plan" a subcommand
        pass

    return root


def run(*args: str):
    return CliRunner().invoke(app(), ["plan", *args])


def test_text_report():
    result = run("--model", "tiny-gpt", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2")
    assert result.exit_code == 0, result.output
    assert "reshard plan: tiny-gpt" in result.output
    assert "valid" in result.output and "yes" in result.output


def test_json_report_has_the_documented_keys():
    result = run(
        "--model", "tiny-gpt", "--src", "tp=2,ep=2,dp=2", "--dst", "tp=2,dp=2", "--dst-offset", "4", "--json"
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert KEYS <= data.keys()
    assert data["ranks"] == 8 and data["valid"] is True
    assert data["bytes_local_total"] == 0  # disjoint ranks: nothing is local
    assert data["bytes_remote_total"] == sum(r["bytes_received"] for r in data["per_rank"])
    assert len(data["per_rank"]) == 8


def test_batches_and_sampling_options():
    result = run(
        "--model",
        "llama3-8b",
        "--src",
        "tp=8,pp=4",
        "--dst",
        "tp=8,dp=4",
        "--max-batch-bytes",
        "1GiB",
        "--sample",
        "4",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ranks"] == 32 and data["ranks_planned"] < 32 and data["valid"]


def test_bad_layout_string_is_a_usage_error():
    result = run("--model", "tiny-gpt", "--src", "tp=2,pp=x", "--dst", "tp=4")
    assert result.exit_code == 2
    assert result.output.strip() == "error: --src: bad layout 'tp=2,pp=x': pp='x' is not a whole number"


def test_unknown_model_and_bad_byte_size_are_usage_errors():
    result = run("--model", "gpt-17", "--src", "tp=2", "--dst", "tp=4")
    assert result.exit_code == 2
    assert result.output.startswith("error: --model: unknown model 'gpt-17': use one of deepseek-v3, ")
    result = run("--model", "tiny-gpt", "--src", "tp=2", "--dst", "tp=4", "--max-batch-bytes", "lots")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --max-batch-bytes: bad byte size 'lots': use e.g. 4096, 64MiB or 1GB"
    )


def test_layout_that_does_not_fit_the_model_is_a_usage_error():
    result = run("--model", "tiny-gpt", "--src", "ep=3,dp=3", "--dst", "tp=1")
    assert result.exit_code == 2
    assert result.output.strip() == "error: 4 experts do not split evenly over ep=3"


def test_plan_errors_and_invalid_plans_are_one_line_and_exit_1(monkeypatch):
    from reshard_core.errors import ReshardError
    from reshard_core.simulate import run as simulate_run

    real = simulate_run.simulate

    def failing(*args, **kwargs):
        raise ReshardError("w: source ranks disagree on shape or dtype")

    monkeypatch.setattr(simulate_run, "simulate", failing)
    result = run("--model", "tiny-gpt", "--src", "tp=2", "--dst", "tp=1")
    assert result.exit_code == 1 and result.stderr == "error: w: source ranks disagree on shape or dtype\n"

    def invalid(*args, **kwargs):
        report = real(*args, **kwargs)
        report.valid, report.problems = False, ["rank 1 never receives w"]
        return report

    monkeypatch.setattr(simulate_run, "simulate", invalid)
    result = run("--model", "tiny-gpt", "--src", "tp=2", "--dst", "tp=1")
    assert result.exit_code == 1
    assert result.stderr == "error: plan is not valid: rank 1 never receives w\n"


def test_layouts_have_megatrons_meaning_ep_is_carved_out_of_dp():
    result = run("--model", "tiny-gpt", "--src", "tp=2,ep=2,dp=2", "--dst", "tp=1,dp=4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ranks"] == 4  # world = tp·pp·cp·dp, not tp·ep·dp
    assert (data["src"], data["dst"]) == ("tp=2,ep=2,dp=2", "dp=4")
    result = run("--model", "tiny-gpt", "--src", "ep=2", "--dst", "tp=1")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --src: bad layout 'ep=2': ep=2 must divide dp=1 (EP is carved out of data parallelism: "
        "world = tp·pp·cp·dp)"
    )


def test_expert_tensor_parallel_times_ep_must_divide_the_dense_grid():
    result = run("--model", "tiny-gpt", "--src", "tp=1,etp=2,ep=2,dp=2", "--dst", "tp=1")
    assert result.exit_code == 2
    assert (
        result.output.strip()
        == "error: --src: bad layout 'tp=1,etp=2,ep=2,dp=2': etp·ep=4 must divide tp·cp·dp=2"
    )


def test_a_tp_size_that_does_not_divide_heads_or_query_groups_is_refused_unless_allowed():
    result = run("--model", "tiny-gpt", "--src", "tp=4", "--dst", "tp=3")  # 4 heads, 2 query groups
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --dst: bad layout 'tp=3': tp=3 does not divide the model's 4 attention heads "
        "(--allow-uneven plans it anyway)"
    )
    result = run("--model", "llama3-8b", "--src", "tp=3", "--dst", "tp=1", "--sample", "2")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --src: bad layout 'tp=3': tp=3 does not divide the model's 32 attention heads "
        "(--allow-uneven plans it anyway)"
    )
    result = run("--model", "tiny-gpt", "--src", "tp=2", "--dst", "tp=3", "--allow-uneven", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["valid"] is True


def test_tp_a_multiple_of_the_query_groups_is_planned_as_megatron_lays_it_out():
    # llama3-8b: 8 query groups; TP16 splits each group's fused q/k/v rows over 2 ranks
    cases = [
        ("--src", "tp=16", "--dst", "tp=16"),
        ("--src", "tp=16", "--dst", "fsdp=16", "--dst-format", "hf"),
        ("--src", "tp=16", "--dst", "tp=16", "--dst-format", "vllm"),
        ("--src", "fsdp=8", "--src-format", "hf", "--dst", "tp=16"),
    ]
    for flags in cases:
        result = run("--model", "llama3-8b", *flags, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["valid"] is True


def test_a_json_shape_file_states_heads_for_the_check(tmp_path):
    shapes = tmp_path / "m.json"
    shapes.write_text(
        '{"num_attention_heads": 6, "num_query_groups": 3, '
        '"tensors": [{"name": "w", "shape": [6, 4], "kind": "column"}]}'
    )
    result = run("--model", str(shapes), "--src", "tp=2", "--dst", "tp=3")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --src: bad layout 'tp=2': tp=2 neither divides nor is a multiple of the model's 3 query "
        "groups (--allow-uneven plans it anyway)"
    )


def test_json_shape_file_errors_name_the_file_and_the_missing_key(tmp_path):
    cases = {
        "no_tensors.json": ('{"name": "m"}', "the top level is missing key 'tensors'"),
        "no_shape.json": ('{"tensors": [{"name": "w"}]}', "tensors[0] (w) is missing key 'shape'"),
        "no_name.json": ('{"tensors": [{"name": "v", "shape": [2]}, {"shape": [2]}]}',
                         "tensors[1] is missing key 'name'"),
        "bad.json": ('{"tensors": [', None),
    }  # fmt: skip
    for file_name, (text, message) in cases.items():
        path = tmp_path / file_name
        path.write_text(text)
        result = run("--model", str(path), "--src", "tp=1", "--dst", "tp=1")
        assert result.exit_code == 2, (file_name, result.output)
        if message is None:
            assert result.output.startswith(f"error: {path}: not valid JSON (")
        else:
            assert result.output.strip() == f"error: {path}: {message}"
