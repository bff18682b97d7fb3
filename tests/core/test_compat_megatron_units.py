"""``reshard_core.compat.megatron`` without a world: argument checks (exact texts), unwrapping,
post-refit hooks, the Megatron CopyService adapter, the MXFP8 config test and its refusal."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from reshard_core.compat import megatron as compat
from reshard_core.compat.megatron_mxfp8 import mxfp8_layers, setup_mxfp8, wants_mxfp8
from reshard_core.compat.megatron_service import MegatronServiceAdapter, is_copy_service_like
from reshard_core.errors import ReshardError


class _OldService:  # megatron-core 0.16.1: no task_id
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submit_send(self, src_tensor, dest_rank):
        self.calls.append(("send", dest_rank))

    def submit_recv(self, dest_tensor, src_rank):
        self.calls.append(("recv", src_rank))

    def run(self):
        self.calls.append(("run",))


class _NewService(_OldService):  # newer Megatron: an optional task_id
    def submit_send(self, src_tensor, dest_rank, task_id=None):
        self.calls.append(("send", dest_rank, task_id))

    def submit_recv(self, dest_tensor, src_rank, task_id=None):
        self.calls.append(("recv", src_rank, task_id))


def test_a_refit_method_that_is_neither_a_name_nor_a_service_is_megatrons_type_error():
    with pytest.raises(TypeError) as info:
        compat.swap_model_weights(None, None, 42)
    assert str(info.value) == "refit_method must be a str backend name or a CopyService instance"


def test_rank_offsets_are_refused_with_the_reason():
    with pytest.raises(ValueError) as info:
        compat.reshard_model_weights(None, None, _OldService(), src_rank_offset=0, dst_rank_offset=8)
    assert str(info.value) == (
        "src_rank_offset=0, dst_rank_offset=8: reshard refits within one torch.distributed world whose "
        "process groups already hold global ranks; build both models' groups in that world and pass offsets 0"
    )


def test_a_transform_that_is_not_reshards_is_a_type_error_naming_it():
    class ReshardTransform:  # Megatron's class of that name, stood in by name only
        pass

    with pytest.raises(TypeError) as info:
        compat.reshard_model_weights(None, None, _OldService(), transform=ReshardTransform())
    assert str(info.value) == (
        f"transform must be a reshard_core.ReshardTransform, got {__name__}.ReshardTransform "
        "(for MXFP8 use reshard_mxfp8.MXFP8ReshardTransform)"
    )


def test_an_unknown_backend_name_lists_the_installed_transports():
    with pytest.raises(ValueError) as info:
        compat.get_or_create_service("nixl")
    assert str(info.value).startswith("Unknown backend 'nixl'; installed transports: ")
    assert "gloo" in str(info.value).split(": ", 1)[1].split(", ")


def test_models_come_unwrapped_as_lists_and_must_have_a_pg_collection():
    core = torch.nn.Linear(2, 2)
    core.pg_collection = SimpleNamespace(dp=object())

    class Float16Module(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    class DistributedDataParallel(Float16Module):
        pass

    assert compat._cores([DistributedDataParallel(Float16Module(core))], "Source") == [core]
    assert compat._cores(core, "Target") == [core]
    assert compat._cores([], "Target") is None and compat._cores(None, "Source") is None
    with pytest.raises(RuntimeError) as info:
        compat._cores([torch.nn.Linear(2, 2)], "Target")
    assert str(info.value) == "Target model missing pg_collection required for reshard"


def test_post_refit_hooks_run_in_module_order_post_refit_first():
    calls = []
    root = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sequential(torch.nn.Linear(1, 1)))
    root.post_refit = lambda: calls.append("root.post_refit")
    root[0].refresh_cache = lambda: calls.append("0.refresh_cache")
    root[1][0].post_refit = lambda: calls.append("1.0.post_refit")
    root[1][0].refresh_cache = lambda: calls.append("1.0.refresh_cache")
    assert compat.run_post_refit_hooks(root) == 3
    assert calls == ["root.post_refit", "0.refresh_cache", "1.0.post_refit"]


@pytest.mark.parametrize("service_cls", [_OldService, _NewService])
def test_the_adapter_forwards_each_op_with_a_task_id_only_where_the_service_takes_one(service_cls):
    service = service_cls()
    adapter = MegatronServiceAdapter(service)
    adapter.submit_recv(torch.empty(3), 2, 11)
    adapter.submit_send(torch.empty(3), 1, 12)
    adapter.run()
    adapter.close()
    if service_cls is _OldService:
        assert service.calls == [("recv", 2), ("send", 1), ("run",)]
    else:
        assert service.calls == [("recv", 2, 11), ("send", 1, 12), ("run",)]
    assert adapter.name == f"megatron:{service_cls.__name__}"
    assert (adapter.device, adapter.one_sided, adapter.independent_rounds) == ("any", False, False)


def test_a_megatron_service_is_wrapped_once_and_a_reshard_service_passes_through():
    service = _NewService()
    assert is_copy_service_like(service) and not is_copy_service_like(object())
    first = compat._service(service, None)
    assert isinstance(first, MegatronServiceAdapter) and first.service is service
    assert compat._service(service, None) is first
    assert compat._service(first, None) is first
    compat.clear_service_cache()


class _Recipe(enum.Enum):
    mxfp8 = "mxfp8"


@pytest.mark.parametrize(
    ("impl", "recipe", "wanted"),
    [
        ("inference_optimized", "mxfp8", True),
        ("inference_optimized", _Recipe.mxfp8, True),
        ("transformer_engine", "mxfp8", False),
        ("inference_optimized", None, False),
    ],  # fmt: skip
)
def test_mxfp8_is_wanted_only_for_inference_optimized_mxfp8_configs(impl, recipe, wanted):
    model = SimpleNamespace(config=SimpleNamespace(transformer_impl=impl, fp8_recipe=recipe))
    assert wants_mxfp8(model) is wanted
    assert wants_mxfp8(None) is False


class InferenceLayerNormColumnParallelLinear(nn.Module):
    """megatron-core 0.16.1's layer of that name at TP 1, minus its TE RMSNorm (TE cannot run on CPU, and
    without TE 0.16.1 cannot even build it): ``forward`` is its ``torch.matmul(x, self.weight.t())``
    (``tensor_parallel/inference_layers.py:159``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(64, 64, generator=g).to(torch.bfloat16))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.matmul(x, self.weight.t()), None


class InferenceRowParallelLinear(InferenceLayerNormColumnParallelLinear):
    """0.16.1's ``InferenceRowParallelLinear.forward`` at TP 1 (``inference_layers.py:287-289``), the same
    matmul."""


class _InferenceGPT(nn.Module):
    """One attention block of an ``inference_optimized`` GPT: the module names and classes the set-up sees."""

    def __init__(self, fp8_recipe: str | None = "mxfp8") -> None:
        super().__init__()
        self.config = SimpleNamespace(transformer_impl="inference_optimized", fp8_recipe=fp8_recipe)
        self.pg_collection = SimpleNamespace()  # compat.megatron requires one; no groups: one process
        attention = nn.Module()
        attention.linear_qkv = InferenceLayerNormColumnParallelLinear(seed=1)
        attention.linear_proj = InferenceRowParallelLinear(seed=2)
        layer = nn.Module()
        layer.self_attention = attention
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([layer])
        self.decoder.final_layernorm = nn.LayerNorm(64)  # not a linear: never concerned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = self.decoder.layers[0].self_attention
        return attention.linear_proj(attention.linear_qkv(x)[0])[0]


def _state(model: nn.Module) -> dict[str, tuple]:
    tensors = model.state_dict(keep_vars=True)
    return {n: (type(t), t.dtype, t.data_ptr(), t.clone()) for n, t in tensors.items()}


def _unchanged(model: nn.Module, before: dict[str, tuple]) -> bool:
    now = _state(model)
    return now.keys() == before.keys() and all(
        now[n][:3] == before[n][:3] and torch.equal(now[n][3], before[n][3]) for n in now
    )


def test_an_mxfp8_destination_config_is_refused_and_the_destination_still_runs():
    model = _InferenceGPT()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out, before = model(x), _state(model)
    refusal = None
    try:
        setup_mxfp8(model)
    except ReshardError as exc:
        refusal = str(exc)
    assert torch.equal(model(x), out)  # the destination's forward after the set-up
    assert _unchanged(model, before)
    qkv, proj = "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj"
    assert mxfp8_layers(model) == [(qkv, "InferenceLayerNormColumnParallelLinear"),
                                   (proj, "InferenceRowParallelLinear")]  # fmt: skip
    assert refusal is not None and refusal.startswith(
        f"cannot set up MXFP8 weights for {qkv} (InferenceLayerNormColumnParallelLinear) (and 1 more "
        "linear layers): the destination config asks for inference-optimized MXFP8"
    )
    assert "torch.matmul(x, self.weight.t())" in refusal and "refused before any data moved" in refusal
    # compat's entry points refuse before their first collective (no world here: reaching it would fail)
    for call in (
        lambda: compat.prepare_swap_model_weights(None, [model], refit_method=_OldService()),
        lambda: compat.reshard_model_weights(None, [model], _OldService()),
    ):
        with pytest.raises(ReshardError) as info:
            call()
        assert str(info.value) == refusal
    assert _unchanged(model, before)


def test_the_buffers_the_refusal_avoids_would_fail_the_destinations_forward():
    """What the set-up did before it refused: reshard's MXFP8 buffers in the linears' place; then the
    destination's forward fails, for both buffer forms."""
    mx = pytest.importorskip("reshard_mxfp8")
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    for form, dtype in (("pair", "unsigned char"), ("flashinfer", "Float8_e4m3fn")):
        model = _InferenceGPT()
        made = mx.make_mxfp8(model, [f"{name}.weight" for name, _ in mxfp8_layers(model)], form=form)
        assert len(made) == 2
        with pytest.raises(RuntimeError, match=f"expected m1 and m2 to have the same dtype.*{dtype}"):
            model(x)
        assert setup_mxfp8(model) == made  # destinations the caller installed are kept, not refused


def test_a_destination_that_does_not_ask_for_mxfp8_is_left_alone():
    for model in (_InferenceGPT(fp8_recipe=None), SimpleNamespace(config=None)):
        assert setup_mxfp8(model) == {}
    no_linear = _InferenceGPT()
    del no_linear.decoder.layers
    assert mxfp8_layers(no_linear) == [] and setup_mxfp8(no_linear) == {}
