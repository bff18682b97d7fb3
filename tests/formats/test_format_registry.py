"""Finding formats: the ``reshard_formats`` hook, detection order, declarations, ``reshard formats list``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from reshard_core.cli.main import main
from reshard_core.errors import PluginError
from reshard_core.formats import CanonicalFormat, ModelFormat, declare_format, format_named, resolve_format
from reshard_core.formats.registry import available_formats
from reshard_core.hookspecs import hookimpl
from reshard_core.plugins import register_plugin

pytestmark = pytest.mark.usefixtures("fresh_plugin_manager")


class Engine(nn.Module):
    """A custom engine: one weight stored transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.w_t = nn.Parameter(torch.zeros(3, 2))


class EngineFormat(ModelFormat):
    name = "engine"
    description = "a custom engine"

    def detect(self, model) -> bool:
        return isinstance(model, Engine)


class _Provider:
    @hookimpl
    def reshard_formats(self):
        return [EngineFormat()]


def test_builtin_formats_are_found_and_a_plugin_format_is_detected_first():
    builtin = [f.name for f in available_formats()]
    assert "hf" in builtin and builtin[-1] == "hf-checkpoint"  # the identity mapping is asked last
    assert resolve_format(Engine(), None) is None
    register_plugin(_Provider(), name="engine-plugin")
    assert available_formats()[0].name == "engine"
    assert resolve_format(Engine(), None).name == "engine"
    assert resolve_format(nn.Linear(2, 2), None) is None
    assert resolve_format(None, None) is None


def test_given_and_declared_formats_win_over_detection():
    mine = CanonicalFormat()
    assert resolve_format(Engine(), mine) is mine
    assert resolve_format(Engine(), "hf-checkpoint").name == "hf-checkpoint"
    engine = declare_format(Engine(), "hf-checkpoint")
    assert resolve_format(engine, None).name == "hf-checkpoint"
    assert resolve_format([engine, Engine()], None).name == "hf-checkpoint"  # pipeline chunks: the first


def test_transformers_models_are_detected():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    assert resolve_format(model, None).name == "hf"


def test_unknown_and_broken_formats_are_named():
    with pytest.raises(PluginError) as info:
        format_named("nope")
    assert str(info.value).startswith("unknown model format 'nope'; known formats: hf, hf-checkpoint")

    class Broken:
        @hookimpl
        def reshard_formats(self):
            return ["not a format"]

    register_plugin(Broken(), name="broken-formats")
    with pytest.raises(PluginError) as info:
        available_formats()
    assert str(info.value) == (
        "plugin 'broken-formats': reshard_formats returned 'not a format', "
        "not a named reshard_core.ModelFormat"
    )


def test_formats_list_json_is_in_detection_order_with_providers(capsys):
    register_plugin(_Provider(), name="engine-plugin")
    with pytest.raises(SystemExit) as exit_info:
        main(["formats", "list", "--json"])
    assert (exit_info.value.code or 0) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {
        "name": "engine", "provider": "engine-plugin", "description": "a custom engine", "model_types": None
    }
    assert "hf" in [r["name"] for r in rows] and rows[-1]["name"] == "hf-checkpoint"
    assert {r["provider"] for r in rows[1:]} == {"reshard_core.builtin_hooks"}
    types = {r["name"]: r["model_types"] for r in rows}
    families = ["deepseek_v3", "glm4_moe", "gpt_oss", "kimi_k2", "llama", "mistral", "qwen2", "qwen2_moe",
                "qwen3", "qwen3_moe", "qwen3_next"]  # fmt: skip
    assert types["vllm"] == types["megatron"] == families
    assert types["hf"] is None and types["hf-checkpoint"] is None
