"""An attention backend that keeps no weights to refit is refused by name, with the one to choose.

vLLM's ``AMX_MLA`` (picked on CPUs with AMX tiles) packs ``kv_b_proj`` into its own kernel and frees
the weight: an update could neither write it nor re-derive what decode uses. This machine has no AMX,
so a module reporting that backend stands in for the real layer.
"""

from __future__ import annotations

import pytest
import torch
from reshard_vllm.layout import check_refittable, refused_backend

from reshard_core import ReshardError


class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_name(self) -> str:
        return self.name


def _model(backend: str) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layer = torch.nn.Module()
    model.layer.attn = torch.nn.Module()
    model.layer.attn.attn_backend = _Backend(backend)
    return model


def test_amx_mla_is_refused_naming_the_layer_and_the_backend_to_choose():
    text = (
        "reshard: layer layer.attn uses vLLM's AMX_MLA attention backend: it packs kv_b_proj into its own "
        "kernel and frees the weight, so there is nothing to refit in place; start the engine with "
        "--attention-backend CPU_MLA"
    )
    assert refused_backend(_model("AMX_MLA")) == text
    with pytest.raises(ReshardError) as error:
        check_refittable(_model("AMX_MLA"), 0)
    assert str(error.value) == text
    assert refused_backend(_model("CPU_MLA")) == ""
