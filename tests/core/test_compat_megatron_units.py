"""``reshard_core.compat.megatron`` without a world: argument checks (exact texts), unwrapping,
post-refit hooks, the Megatron CopyService adapter and the MXFP8 config test."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import pytest
import torch

from reshard_core.compat import megatron as compat
from reshard_core.compat.megatron_mxfp8 import mxfp8_form, wants_mxfp8
from reshard_core.compat.megatron_service import MegatronServiceAdapter, is_copy_service_like


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


def test_the_mxfp8_buffer_form_follows_the_grouped_gemm_backend():
    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert mxfp8_form(model(inference_grouped_gemm_backend="flashinfer")) == "flashinfer"
    assert mxfp8_form(model(inference_grouped_gemm_backend="torch")) == "pair"
    assert mxfp8_form(model()) == "pair"
