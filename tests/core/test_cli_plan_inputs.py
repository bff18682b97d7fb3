"""``reshard plan`` on malformed input: every bad flag or shape-file entry is one line on stderr that
names the flag, or the file, the entry and the key, and exit 2 — never a traceback, never a plan
with wrong numbers. Also: plans within one format report no converter comparison."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from reshard_core.cli import plan_cmd


def app() -> typer.Typer:
    root = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    plan_cmd.register(root)

    @root.command("noop", hidden=True)
    def noop() -> None:  # a second command keeps "plan" a subcommand
        pass

    return root


def run(*args: str):
    return CliRunner().invoke(app(), ["plan", *args])


def entry(name: str = "w", **keys: object) -> dict:
    """A valid tensor entry, with ``keys`` added or replaced (a value of ``...`` drops the key)."""
    out = {"name": name, "shape": [8, 4], "kind": "column", **keys}
    return {k: v for k, v in out.items() if v is not ...}


def doc(bad: object, at: int = 1, **top: object) -> dict:
    """A shape file whose entry ``at`` is ``bad`` between valid ones, with top-level ``top``."""
    tensors = [entry("a"), entry("b"), entry("c")]
    tensors[at] = bad
    return {"name": "m", "num_layers": 2, **top, "tensors": tensors}


def top(**keys: object) -> dict:
    """A valid shape file with top-level ``keys`` added or replaced (``...`` drops one)."""
    out = {"name": "m", "num_layers": 2, "tensors": [entry()], **keys}
    return {k: v for k, v in out.items() if v is not ...}


# (id, shape file, entry index or None for the top level, key named in the message)
SHAPE_FILES = [
    ("dim-float", doc(entry(shape=[8, 96.7])), 1, "shape"),
    ("dim-negative", doc(entry(shape=[-4, 4])), 1, "shape"),
    ("dim-bool", doc(entry(shape=[True, 4])), 1, "shape"),
    ("dim-string", doc(entry(shape=["8", 4])), 1, "shape"),
    ("dim-nested-list", doc(entry(shape=[[8, 4]])), 1, "shape"),
    ("dim-null", doc(entry(shape=[8, None])), 1, "shape"),
    ("shape-string", doc(entry(shape="8x4")), 1, "shape"),
    ("shape-number", doc(entry(shape=32)), 1, "shape"),
    ("shape-object", doc(entry(shape={"0": 8})), 1, "shape"),
    ("shape-missing", doc(entry(shape=...)), 1, "shape"),
    ("layer-string", doc(entry(layer="0")), 1, "layer"),
    ("layer-bool", doc(entry(layer=True)), 1, "layer"),
    ("layer-float", doc(entry(layer=1.0)), 1, "layer"),
    ("layer-below-minus-one", doc(entry(layer=-2)), 1, "layer"),
    ("layer-past-num-layers", doc(entry(layer=3)), 1, "layer"),
    ("layer-named-past-num-layers", doc(entry("decoder.layers.5.w")), 1, "name"),
    ("expert-negative", doc(entry(expert=-1)), 1, "expert"),
    ("expert-string", doc(entry(expert="3")), 1, "expert"),
    ("expert-float", doc(entry(expert=1.5)), 1, "expert"),
    ("expert-bool", doc(entry(expert=False)), 1, "expert"),
    ("dtype-unknown", doc(entry(dtype="float99")), 1, "dtype"),
    ("dtype-number", doc(entry(dtype=16)), 1, "dtype"),
    ("dtype-not-a-dtype", doc(entry(dtype="Tensor")), 1, "dtype"),
    ("kind-unknown", doc(entry(kind="diagonal")), 1, "kind"),
    ("kind-list", doc(entry(kind=["column"])), 1, "kind"),
    ("kind-row-on-1d", doc(entry(kind="row", shape=[8])), 1, "kind"),
    ("name-empty", doc(entry("")), 1, "name"),
    ("name-number", doc(entry(7)), 1, "name"),
    ("name-null", doc(entry(None)), 1, "name"),
    ("name-missing", doc(entry(name=...)), 1, "name"),
    ("name-duplicate", doc(entry("a"), at=2), 2, "name"),
    ("unknown-key-typo", doc({**entry(), "shpae": [8, 4]}), 1, "shpae"),
    ("unknown-key", doc({**entry(), "dtpye": "float32"}), 1, "dtpye"),
    ("entry-not-object", doc(5), 1, None),
    ("heads-string", top(num_attention_heads="eight"), None, "num_attention_heads"),
    ("heads-zero", top(num_attention_heads=0), None, "num_attention_heads"),
    ("groups-float", top(num_query_groups=2.0), None, "num_query_groups"),
    ("num-layers-string", top(num_layers="2"), None, "num_layers"),
    ("num-layers-negative", top(num_layers=-1), None, "num_layers"),
    ("model-name-number", top(name=5), None, "name"),
    ("tensors-object", top(tensors={"w": [8, 4]}), None, "tensors"),
    ("tensors-empty", top(tensors=[]), None, "tensors"),
    ("tensors-missing", top(tensors=...), None, "tensors"),
    ("unknown-top-key", top(num_layer=2), None, "num_layer"),
]

LAYOUT = ("--src", "tp=2", "--dst", "tp=1")

# (flags after --model tiny-gpt, the flag named in the message)
BAD_FLAGS = [
    (("--sample", "0", *LAYOUT), "--sample"),
    (("--sample", "-3", *LAYOUT), "--sample"),
    (("--sample", "two", *LAYOUT), "--sample"),
    (("--sample", "1.5", *LAYOUT), "--sample"),
    (("--dst-offset", "-1", *LAYOUT), "--dst-offset"),
    (("--dst-offset", "1.5", *LAYOUT), "--dst-offset"),
    (("--max-batch-bytes", "lots", *LAYOUT), "--max-batch-bytes"),
    (("--max-batch-bytes", "0", *LAYOUT), "--max-batch-bytes"),
    (("--max-batch-bytes", "-5MB", *LAYOUT), "--max-batch-bytes"),
    (("--max-batch-bytes", "12parsecs", *LAYOUT), "--max-batch-bytes"),
    (("--src", "tp=2,pp=x", "--dst", "tp=1"), "--src"),
    (("--src", "", "--dst", "tp=1"), "--src"),
    (("--src", "tp=2", "--dst", "tq=2"), "--dst"),
    (("--src", "tp=2", "--dst", "tp=0"), "--dst"),
    (("--src", "ep=2", "--dst", "tp=1"), "--src"),
    (("--src", "tp=2", "--dst", "tp=8"), "--dst"),  # tiny-gpt's 4 heads
    (("--src-format", "nonsense", *LAYOUT), "--src-format"),
    (("--dst-format", "MEGATRON", *LAYOUT), "--dst-format"),
    (("--dst-format", "", *LAYOUT), "--dst-format"),
    (("--src-format", "vllm", "--src", "tp=2,pp=2", "--dst", "tp=1"), "--src-format"),
]


def check_one_line_usage_error(result) -> str:
    """The single ``error: `` line of a usage error (exit 2, nothing on stdout, no traceback)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("document", "index", "key"),
    [case[1:] for case in SHAPE_FILES],
    ids=[case[0] for case in SHAPE_FILES],
)
def test_a_malformed_shape_file_is_one_line_naming_the_file_entry_and_key(tmp_path, document, index, key):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(document))
    message = check_one_line_usage_error(run("--model", str(path), *LAYOUT))
    assert message.startswith(f"error: {path}: "), message
    if index is not None:
        assert f"tensors[{index}]" in message
    if key is not None:
        assert f"key {key!r}" in message


@pytest.mark.parametrize(("flags", "flag"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_the_flag(flags, flag):
    message = check_one_line_usage_error(run("--model", "tiny-gpt", *flags))
    assert message.startswith(f"error: {flag}: "), message


def test_model_flag_errors(tmp_path):
    message = check_one_line_usage_error(run("--model", "gpt-17", *LAYOUT))
    assert message.startswith("error: --model: unknown model 'gpt-17': use one of deepseek-v3, ")
    missing = tmp_path / "missing.json"
    message = check_one_line_usage_error(run("--model", str(missing), *LAYOUT))
    assert message == f"error: {missing}: cannot read it (No such file or directory)"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(top()))
    message = check_one_line_usage_error(run("--model", str(path), "--dst-format", "vllm", *LAYOUT))
    assert message.startswith("error: --dst-format: formats plan catalogue models only (deepseek-v3, ")


def test_messages_say_what_the_key_must_be(tmp_path):
    path = tmp_path / "shapes.json"
    cases = {
        "dimension 1 is 96.7, not a non-negative integer":
            doc(entry("decoder.layers.0.mlp.linear_fc1.weight", shape=[8, 96.7]), at=1),
        'key \'layer\': "0" is not an integer from -1 to 2': doc(entry(layer="0")),
        "key 'shape': \"8x4\" is not a list of dimensions": doc(entry(shape="8x4")),
        "key 'num_attention_heads': \"eight\" is not a positive integer": top(num_attention_heads="eight"),
        "key 'shpae' is not one of 'name', 'shape', 'dtype', 'kind', 'layer', 'expert'":
            doc({**entry(), "shpae": [8, 4]}),
    }  # fmt: skip
    for expected, document in cases.items():
        path.write_text(json.dumps(document))
        message = check_one_line_usage_error(run("--model", str(path), *LAYOUT))
        assert message.endswith(expected), (expected, message)
    path.write_text(json.dumps(doc(entry("decoder.layers.0.mlp.linear_fc1.weight", shape=[8, 96.7]))))
    message = check_one_line_usage_error(run("--model", str(path), *LAYOUT))
    assert message == (
        f"error: {path}: tensors[1] (decoder.layers.0.mlp.linear_fc1.weight): key 'shape': "
        "dimension 1 is 96.7, not a non-negative integer"
    )


def test_a_duplicated_entry_is_refused_naming_both_indices(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text(json.dumps({"tensors": [entry("w"), entry("v"), entry("w", shape=[8, 4])]}))
    message = check_one_line_usage_error(run("--model", str(path), *LAYOUT))
    assert message == f"error: {path}: tensors[2] (w): key 'name': 'w' is also tensors[0]"


def test_sample_below_one_is_refused():
    for n in ("0", "-3"):
        result = run("--model", "llama3-8b", "--src", "tp=8,pp=4", "--dst", "tp=8", "--sample", n)
        assert check_one_line_usage_error(result) == f"error: --sample: must be >= 1, not {n}"


def plan_json(*flags: str) -> dict:
    result = run("--model", "tiny-gpt", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2", "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_megatron_on_both_sides_plans_without_formats_and_no_converter_comparison():
    plain = plan_json()
    moved = ("bytes_remote_total", "bytes_local_total", "bytes_received_total", "tensors", "ranks")
    for flags in (("--src-format", "megatron"), ("--dst-format", "megatron"),
                  ("--src-format", "megatron", "--dst-format", "megatron")):  # fmt: skip
        data = plan_json(*flags)
        assert data["formats"] == ["megatron", "megatron"]
        assert data["gather_first_bytes"] is None
        assert {k: data[k] for k in moved} == {k: plain[k] for k in moved}, flags
    result = run("--model", "tiny-gpt", "--src", "tp=2,pp=2", "--dst", "tp=2,dp=2", "--src-format=megatron")
    assert result.exit_code == 0, result.output
    assert "gather-first" not in result.output and "(megatron → megatron)" in result.output


def test_one_format_other_than_megatron_on_both_sides_has_no_converter_comparison():
    result = run(
        "--model", "tiny-gpt", "--src", "fsdp=2", "--dst", "fsdp=4",
        "--src-format", "hf", "--dst-format", "hf", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["valid"] and data["formats"] == ["hf", "hf"] and data["gather_first_bytes"] is None


def test_across_formats_the_converter_comparison_stays():
    result = run("--model", "tiny-gpt", "--src", "tp=2", "--dst", "fsdp=2", "--dst-format", "hf", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["formats"] == ["megatron", "hf"] and data["gather_first_bytes"] > 0


def test_the_reshard_entry_point_prints_no_traceback(tmp_path, capsys):
    from reshard_core.cli.main import main

    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(doc(entry(layer="0"))))
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", str(path), *LAYOUT])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    assert err == f"error: {path}: tensors[1] (w): key 'layer': \"0\" is not an integer from -1 to 2\n"


CLICK_ERRORS = [
    (["plan", "--smaple", "3", "--model", "tiny-gpt", *LAYOUT],
     "error: No such option: --smaple (Possible options: --sample) (see 'reshard plan --help')\n"),
    (["plan", "--model", "tiny-gpt", "--src", "tp=2"],
     "error: Missing option '--dst'. (see 'reshard plan --help')\n"),
    (["plan", "--model", "tiny-gpt", *LAYOUT, "--all-ranks=3"],
     "error: Option '--all-ranks' does not take a value.\n"),
    (["nosuch"], "error: No such command 'nosuch'. (see 'reshard --help')\n"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "want"), CLICK_ERRORS, ids=["typo", "missing", "value", "command"])
def test_errors_click_finds_are_one_line_too(argv, want, capsys):
    from reshard_core.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and err == want
