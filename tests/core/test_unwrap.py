"""``reshard_core.extract.unwrap``: the one definition of a wrapper that detection, formats and
extraction share.

Root wrappers are removed by class name (torch's and Megatron's DDP, FSDP1, Megatron's precision
wrappers) only when ``.module`` is a module; path wrappers are dropped from qualnames.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from reshard_core.extract import strip_wrappers, unwrap, unwrap_all
from reshard_core.extract.unwrap import ROOT_WRAPPERS
from reshard_core.formats import resolve_format


def _wrapper(class_name: str, inner: object) -> nn.Module:
    """An instance of a class named ``class_name`` holding ``inner`` as ``.module`` (Megatron's
    wrappers are matched by name, so their classes need not be importable here)."""
    cls = type(class_name, (nn.Module,), {})
    outer = cls()
    if isinstance(inner, nn.Module):
        outer.module = inner
    else:
        object.__setattr__(outer, "module", inner)
    return outer


def test_nested_root_wrappers_are_all_removed():
    model = nn.Linear(2, 2)
    wrapped = _wrapper("Float16Module", _wrapper("DistributedDataParallel", _wrapper("FP8Module", model)))
    assert unwrap(wrapped) is model
    assert unwrap_all([wrapped, model]) == [model, model]
    assert unwrap_all(None) == []
    assert DistributedDataParallel.__name__ in ROOT_WRAPPERS  # matched by name: torch's own class


def test_a_wrapper_named_module_without_a_module_inside_is_kept():
    odd = _wrapper("Float16Module", "not a module")
    assert unwrap(odd) is odd
    other = _wrapper("MyWrapper", nn.Linear(2, 2))  # not a known wrapper: the user's own module
    assert unwrap(other) is other


def test_path_wrappers_are_dropped_from_names_and_nothing_else():
    assert strip_wrappers("a._fsdp_wrapped_module.b._checkpoint_wrapped_module.w") == "a.b.w"
    assert strip_wrappers("_orig_mod.layers.0.weight") == "layers.0.weight"
    assert strip_wrappers("module.layers.0.weight") == "module.layers.0.weight"


def test_format_detection_sees_through_the_same_wrappers_as_extraction():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    found = resolve_format(model, None)
    assert found is not None and found.name == "hf"
    for wrapper in ("FP8Module", "Float16Module", "DistributedDataParallel"):
        wrapped = resolve_format(_wrapper(wrapper, model), None)
        assert wrapped is not None and wrapped.name == found.name, wrapper
