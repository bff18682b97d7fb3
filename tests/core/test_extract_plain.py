"""Plain tensors and the extraction walk: replication by default, ``declare_layout``, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from reshard_core.extract import ExtractContext, ExtractError, declare_layout, extract_specs
from reshard_core.hookspecs import hookimpl
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plugins import register_plugin, unregister_plugin
from reshard_core.specs import TensorMeta, TensorSpec
from reshard_core.testing.world import run_world

SOLO = Layout(Mesh((0,), (1,)), (Replicate(),))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("kept", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def summary(specs):
    return [(s.meta.name, s.meta.shape, s.meta.dtype, s.layout) for s in specs]


def test_parameters_then_persistent_buffers_replicated_over_the_world():
    net = Net()
    specs = extract_specs(net, "src")
    assert summary(specs) == [
        ("lin.weight", (3, 4), torch.float32, SOLO),
        ("lin.bias", (3,), torch.float32, SOLO),
        ("kept", (3,), torch.float32, SOLO),
    ]
    assert specs[0].tensor is net.lin.weight and specs[2].tensor is net.kept


def test_shared_tensor_reported_once_under_its_first_name():
    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    net[1].weight = net[0].weight
    assert [s.meta.name for s in extract_specs(net, "dst")] == ["0.weight"]


def test_wrapper_prefixes_are_removed_from_canonical_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
    compiled = torch.compile(net)
    qualnames = [n for n, _ in compiled.named_parameters()]
    inner = "_orig_mod.0._checkpoint_wrapped_module"
    assert qualnames == [f"{inner}.weight", f"{inner}.bias"]
    assert [s.meta.name for s in extract_specs(compiled, "src")] == ["0.weight", "0.bias"]


def test_root_wrappers_are_unwrapped_and_model_lists_are_chained():
    class Float16Module(nn.Module):  # named like Megatron's wrapper, holds the model in .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    first, second = nn.Linear(2, 2, bias=False), nn.Linear(2, 3, bias=False)
    declare_layout(second.weight, name="head.weight")
    specs = extract_specs([Float16Module(first), second], "src")
    assert [(s.meta.name, s.meta.shape) for s in specs] == [("weight", (2, 2)), ("head.weight", (3, 2))]
    assert extract_specs(None, "src") == []


def test_declared_uneven_shard_with_global_shape():
    t = torch.zeros(3, 4)  # rank 0's rows of a (5, 4) tensor split over ranks 0 and 1
    assert declare_layout(t, dim=0, ranks=[0, 1], shape=(5, 4), name="w") is t
    net = nn.Module()
    net.register_buffer("buf", t)
    (spec,) = extract_specs(net, "dst")
    assert (spec.meta, spec.layout) == (
        TensorMeta("w", (5, 4), torch.float32),
        Layout(Mesh((0, 1), (2,)), (Shard(0),)),
    )
    assert spec.tensor is t


def test_declared_stride_and_components_default_global_shape():
    strided = declare_layout(torch.zeros(4, 2), dim=0, stride=2, ranks=[0, 1])
    packed = declare_layout(torch.zeros(2, 5), dim=1, components=(6, 4), ranks=[0, 1])
    net = nn.Module()
    net.register_buffer("strided", strided)
    net.register_buffer("packed", packed)
    assert summary(extract_specs(net, "dst")) == [
        ("strided", (8, 2), torch.float32, Layout(Mesh((0, 1), (2,)), (Shard(0, stride=2),))),
        ("packed", (2, 10), torch.float32, Layout(Mesh((0, 1), (2,)), (Shard(1, components=(6, 4)),))),
    ]


def test_declared_full_layout():
    layout = Layout(Mesh((1, 0), (2,)), (Shard(1),))
    t = declare_layout(torch.zeros(2, 2), layout=layout, shape=(2, 5))  # rank 0 is second: cols 3..5
    net = nn.Module()
    net.register_buffer("b", t)
    assert summary(extract_specs(net, "src")) == [("b", (2, 5), torch.float32, layout)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(dim=0, ranks=[0, 1], shape=(5, 4), name="w"),
            "tensor 'w': local shape (2, 4) on rank 0 does not match the declared layout "
            "Layout(mesh=Mesh(ranks=(0, 1), shape=(2,)), placements=(Shard(0),)) of global shape (5, 4), "
            "which gives (3, 4)",
        ),
        (
            dict(dim=1, components=(4, 2), ranks=[0, 1], name="qkv"),
            "tensor 'qkv': local shape (2, 4) on rank 0 does not match the declared layout "
            "Layout(mesh=Mesh(ranks=(0, 1), shape=(2,)), placements=(Shard(1, components=(4, 2)),)) "
            "of global shape (2, 6), which gives (2, 3)",
        ),
        (dict(dim=0, ranks=[1, 2], name="w"), "tensor 'w': rank 0 is not in its declared mesh (1, 2)"),
        (dict(dim=2), "declare_layout: dim=2 is out of range for a 2-d tensor"),
        (dict(stride=2), "declare_layout: stride/components/sizes need dim="),
        (dict(dim=0, ranks=[0, 0]), "declare_layout: mesh ranks repeat: (0, 0)"),
        (dict(dim=0, ranks=[]), "declare_layout: the rank list is empty"),
        (dict(dim=0, stride=0, ranks=[0]), "declare_layout: Shard stride must be >= 1, got 0"),
        (dict(ranks=[0], group=object()), "declare_layout: pass group= or ranks=, not both"),
        (
            dict(dim=0, layout=Layout(Mesh((0,), (1,)), (Replicate(),))),
            "declare_layout: pass either layout= or dim/stride/components/sizes/group/ranks",
        ),
        (dict(shape=(2,)), "declare_layout: global shape (2,) has 1 dims, the tensor has 2"),
    ],
)
def test_bad_declarations(kwargs, message):
    with pytest.raises(ExtractError) as info:
        declare_layout(torch.zeros(2, 4), **kwargs)
    assert str(info.value) == message


def test_declaration_is_rechecked_at_extraction():
    lin = nn.Linear(4, 2, bias=False)
    declare_layout(lin.weight, dim=0, ranks=[0, 1])  # global (4, 4), rank 0 holds 2 rows
    lin.weight.data = torch.zeros(3, 4)
    with pytest.raises(ExtractError) as info:
        extract_specs(lin, "dst")
    assert str(info.value) == (
        "tensor 'weight': local shape (3, 4) on rank 0 does not match the declared layout "
        "Layout(mesh=Mesh(ranks=(0, 1), shape=(2,)), placements=(Shard(0),)) of global shape (4, 4), "
        "which gives (2, 4)"
    )


def test_declare_layout_rejects_non_tensors():
    with pytest.raises(ExtractError, match="^declare_layout expects a tensor, got list$"):
        declare_layout([1, 2])


def test_unclaimed_tensor_is_an_error_naming_it():
    with pytest.raises(ExtractError) as info:
        extract_specs(nn.Sequential(nn.LazyLinear(3)), "src")
    assert str(info.value) == (
        "no extractor claimed src tensor '0.weight' of type UninitializedParameter; install a plugin "
        "for it or declare its layout with reshard_core.declare_layout"
    )


def test_two_tensors_with_one_canonical_name_is_an_error():
    net = nn.Module()
    net.a = nn.Linear(2, 2, bias=False)
    net.b = nn.Linear(2, 2, bias=False)
    declare_layout(net.a.weight, name="shared")
    declare_layout(net.b.weight, name="shared")
    with pytest.raises(ExtractError) as info:
        extract_specs(net, "src")
    assert str(info.value) == "tensors 'a.weight' and 'b.weight' both resolve to canonical name 'shared'"


def test_bad_side_and_bad_model():
    with pytest.raises(ExtractError, match="^side must be 'src' or 'dst', got 'left'$"):
        extract_specs(nn.Linear(1, 1), "left")
    with pytest.raises(ExtractError, match="^expected a torch.nn.Module, got dict$"):
        extract_specs([{}], "src")


def test_a_group_without_a_process_group_is_an_error():
    with pytest.raises(ExtractError) as info:
        ExtractContext.create(object())
    assert str(info.value) == "a process group was given but torch.distributed is not initialised"


class _Rogue:
    """An in-process plugin that claims two tensors wrongly (a plugin runs before the built-ins)."""

    @hookimpl
    def reshard_extract_tensor(self, qualname, tensor):
        if qualname == "weight":
            return "not specs"
        if qualname == "bias":
            return [TensorSpec(TensorMeta("bias", (3,), tensor.dtype), SOLO, tensor)]
        return None


@pytest.fixture
def rogue_plugin():
    name = register_plugin(_Rogue(), name="test-extract-rogue")
    yield
    unregister_plugin(name)


def test_plugin_results_are_checked(rogue_plugin):
    with pytest.raises(ExtractError) as info:
        extract_specs(nn.Linear(2, 2), "src")
    assert str(info.value) == (
        "the reshard_extract_tensor hook of plugin 'test-extract-rogue' returned str for src tensor "
        "'weight', not a list of TensorSpec"
    )
    net = nn.Module()
    net.register_buffer("bias", torch.zeros(2))
    with pytest.raises(ExtractError) as info:
        extract_specs(net, "src")
    assert str(info.value) == (
        "tensor 'bias': local shape (2,) on rank 0 differs from (3,) given by its layout"
    )


def test_plugin_wins_over_builtin(rogue_plugin):
    net = nn.Module()
    net.register_buffer("other", torch.zeros(2))
    assert summary(extract_specs(net, "src")) == [("other", (2,), torch.float32, SOLO)]


def test_importing_extract_never_imports_megatron():
    code = (
        "import sys, torch, reshard_core.extract as e\n"
        "e.extract_specs(torch.nn.Linear(2, 2), 'src')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- two real ranks


def _plain_world(rank: int, world: int):
    import torch.distributed as dist

    full = torch.arange(33 * 4, dtype=torch.float32).reshape(33, 4)
    rows = [(0, 17), (17, 33)][rank]
    net = nn.Module()
    net.register_buffer("rows", declare_layout(full[rows[0] : rows[1]].clone(), dim=0, shape=(33, 4)))
    strided = torch.cat([full[8 * rank : 8 * rank + 8], full[16 + 8 * rank : 24 + 8 * rank]])
    net.register_buffer("gate_up", declare_layout(strided, dim=0, stride=2, name="fused"))
    net.register_buffer("same", full.clone())
    mine = [dist.new_group([r]) for r in range(world)][rank]  # new_group is collective
    out = {}
    for key, group in (("world", None), ("own", mine)):
        specs = extract_specs(net, "src", group=group)
        regions = {}
        for s in specs:
            ref = full if s.meta.name != "fused" else full[:32]
            regions[s.meta.name] = all(
                torch.equal(
                    s.tensor[tuple(slice(o, o + n) for o, n in zip(b.local_offsets, b.sizes, strict=True))],
                    ref[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))],
                )
                for b in s.layout.boxes(s.meta.shape, rank)
            )
        out[key] = (summary(specs), regions)
    try:
        declare_layout(torch.zeros(16, 4), dim=0, shape=(33, 4), name="short")
        out["error"] = None
    except ExtractError as exc:
        out["error"] = str(exc)
    return out


@pytest.mark.slow
def test_declarations_on_two_ranks():
    results = run_world(_plain_world, 2)
    pair = Mesh((0, 1), (2,))
    for rank, out in enumerate(results):
        assert out["world"][0] == [
            ("rows", (33, 4), torch.float32, Layout(pair, (Shard(0),))),
            ("fused", (32, 4), torch.float32, Layout(pair, (Shard(0, stride=2),))),
            ("same", (33, 4), torch.float32, Layout(pair, (Replicate(),))),
        ]
        own = Layout(Mesh((rank,), (1,)), (Replicate(),))
        assert out["own"][0][2] == ("same", (33, 4), torch.float32, own)
        assert out["world"][1] == out["own"][1] == {"rows": True, "fused": True, "same": True}
    assert results[0]["error"] == (
        "tensor 'short': local shape (16, 4) on rank 0 does not match the declared layout "
        "Layout(mesh=Mesh(ranks=(0, 1), shape=(2,)), placements=(Shard(0),)) of global shape (33, 4), "
        "which gives (17, 4)"
    )
    assert results[1]["error"] is None


def test_fsdp1_flat_parameters_are_not_taken_for_plain_tensors():
    class FlatParameter(nn.Parameter):  # FSDP1's flat shard of many params, matched by type name
        pass

    net = nn.Module()
    net._flat_param = FlatParameter(torch.zeros(6))
    with pytest.raises(ExtractError) as info:
        extract_specs(net, "src")
    assert str(info.value) == (
        "no extractor claimed src tensor '_flat_param' of type FlatParameter; install a plugin "
        "for it or declare its layout with reshard_core.declare_layout"
    )
