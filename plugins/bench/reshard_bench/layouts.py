"""Build the pure-torch ``GPT`` in a parallel layout on the current rank, and check it element by element.

A layout string (``fsdp=4``, ``tp=2,dp=2``, ``tp=2,pp=2``; see ``reshard_core.simulate.parallel``)
picks how the model is laid out; ``dp`` fills whatever part of the world the other sizes leave. Three
real ways of holding a model, each read by a different extractor:

- ``fsdp=F`` (with ``dp=D``: HSDP): PyTorch FSDP2 ``fully_shard`` per layer, embedding, output layer
  and root, over a ``(D, F)`` CPU device mesh — DTensor ``Shard(0)`` params, uneven where sizes say so.
- ``tp=T,pp=P`` on the **source** side, as a training framework holds it: each rank builds its TP
  shard of its pipeline stage and stamps Megatron's attributes (``tensor_model_parallel``,
  ``partition_dim``, ``partition_stride``; gated ``fc1`` has stride 2) and a ``pg_collection`` with
  its TP/PP/DP groups — read by duck typing, megatron-core is not needed.
- the same on the **destination** side, as an inference engine holds it: plain tensors whose layout
  is declared with ``reshard_core.declare_layout`` (global names, so pipeline stages need no
  Megatron attributes).

Building is collective over the world (process groups and device meshes are created together).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reshard_core import Layout, declare_layout, parse_parallel
from reshard_core.simulate import Parallel

from .gpt import GPT, GPTConfig, box_values, expected_local, fill_local, tp_layout, tp_placement

STYLES = ("fsdp2", "megatron-style", "declared")


@dataclass
class Holding:
    """One weight as this rank holds it: ``tensor`` (a DTensor under FSDP2, else the local shard),
    its canonical ``name`` and global ``shape``, and the ``layout`` the builder used (None for a
    DTensor, which is checked through ``full_tensor()``)."""

    tensor: torch.Tensor
    name: str
    shape: tuple[int, ...]
    layout: Layout | None


@dataclass
class Built:
    """A model built on this rank in one layout, and what it holds (for verification)."""

    model: nn.Module | None
    holdings: list[Holding]
    style: str
    layout: str


def resolve_layout(text: str, world: int) -> Parallel:
    """Parse ``text`` and let ``dp`` fill the rest of a ``world``-rank world; ``ValueError`` when the
    layout cannot be built here (what the demo supports: tp, pp, dp, fsdp)."""
    par = parse_parallel(text)
    unsupported = [k for k in ("cp", "ep") if getattr(par, k) != 1]
    unsupported += ["etp"] if par.etp not in (None, 1) else []
    if unsupported:
        not_taken = ", ".join(unsupported)
        raise ValueError(f"bad layout {text!r}: this model takes tp, pp, dp and fsdp (not {not_taken})")
    if par.fsdp > 1 and (par.tp > 1 or par.pp > 1):
        raise ValueError(f"bad layout {text!r}: fsdp cannot be combined with tp or pp here")
    if world % par.world:
        raise ValueError(f"bad layout {text!r}: {par.world} ranks do not divide a world of {world}")
    return dataclasses.replace(par, dp=par.dp * world // par.world)


def style_of(par: Parallel, side: str) -> str:
    """How a layout is realised on ``side`` (``"src"`` or ``"dst"``)."""
    if par.fsdp > 1:
        return "fsdp2"
    return "megatron-style" if side == "src" else "declared"


def build_model(
    config: GPTConfig,
    par: Parallel,
    side: str,
    *,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    offset: int = 0,
) -> Built:
    """This rank's part of ``GPT(config)`` in layout ``par`` over ranks ``[offset, offset +
    par.world)``, filled from ``seed`` (``model`` is None on other ranks). Collective over the world.
    FSDP2 layouts must cover the whole world."""
    style = style_of(par, side)
    if style == "fsdp2":
        if offset or par.world != dist.get_world_size():
            raise ValueError(f"an FSDP2 layout ({par}) must cover the whole world of {dist.get_world_size()}")
        model, holdings = _build_fsdp(config, par, seed, dtype)
    else:
        model, holdings = _build_sharded(config, par, seed, dtype, offset, declared=style == "declared")
    return Built(model, holdings, style, str(par))


def check_model(built: Built, seed: int) -> list[str]:
    """Compare every element this rank holds with the values ``seed`` gives; one line per differing
    weight (empty: all equal, bit for bit). Collective for FSDP2 models (``full_tensor()``)."""
    problems = []
    for h in built.holdings:
        if h.layout is None:
            actual = h.tensor.full_tensor()
            expected = box_values(h.name, h.shape, (0,) * len(h.shape), h.shape, seed, actual.dtype)
        else:
            actual = h.tensor.detach()
            expected = expected_local(h.name, h.shape, h.layout, dist.get_rank(), seed, actual.dtype)
        if not torch.equal(actual, expected):
            differ = actual.view(torch.uint8 if actual.dtype.itemsize == 1 else _int_of(actual.dtype))
            same_bits = differ == expected.view(differ.dtype)
            first = tuple(int(i) for i in (~same_bits).nonzero()[0].tolist())
            problems.append(
                f"{h.name}: {int((~same_bits).sum())} of {actual.numel()} elements differ on rank "
                f"{dist.get_rank()} (first at local index {first}: {actual[first].item()!r}, expected "
                f"{expected[first].item()!r})"
            )
    return problems


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


# ------------------------------------------------------------------ FSDP2


def _build_fsdp(
    config: GPTConfig, par: Parallel, seed: int, dtype: torch.dtype
) -> tuple[nn.Module, list[Holding]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device="cpu").to(dtype)
    shapes = config.tensors()
    for name, param in model.named_parameters():
        fill_local(param, name, shapes[name], Layout.replicated((0,)), 0, seed)
    if par.dp > 1:
        mesh = init_device_mesh("cpu", (par.dp, par.fsdp), mesh_dim_names=("dp", "fsdp"))
    else:
        mesh = init_device_mesh("cpu", (par.fsdp,), mesh_dim_names=("fsdp",))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.embedding, mesh=mesh)
    fully_shard(model.output_layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    holdings = [Holding(p, n, shapes[n], None) for n, p in model.named_parameters()]
    return model, holdings


# ------------------------------------------------------------------ Megatron-style and declared TP/PP


def _coords(par: Parallel, rank: int) -> tuple[int, int, int]:
    """(tp, pp, dp) coordinates of ``rank`` (TP fastest, then PP, then DP, as Megatron orders them)."""
    return rank % par.tp, rank // par.tp % par.pp, rank // (par.tp * par.pp)


def _groups(par: Parallel, offset: int) -> dict[str, Any]:
    """This rank's TP, PP and DP groups (None outside the layout's ranks); every rank of the world
    creates every group, in the same order."""
    out = {}
    for key, axis in (("tp", 0), ("pp", 1), ("dp", 2)):
        members: dict[tuple[int, ...], list[int]] = {}
        for r in range(par.world):
            c = _coords(par, r)
            members.setdefault(c[:axis] + c[axis + 1 :], []).append(offset + r)
        out[key], _ = dist.new_subgroups_by_enumeration(list(members.values()))
    return out


def _build_sharded(
    config: GPTConfig, par: Parallel, seed: int, dtype: torch.dtype, offset: int, *, declared: bool
) -> tuple[nn.Module | None, list[Holding]]:
    if config.num_layers % par.pp:
        raise ValueError(f"{config.num_layers} layers do not divide into pp={par.pp} stages")
    rank = dist.get_rank()
    groups = _groups(par, offset)
    if not offset <= rank < offset + par.world:
        return None, []
    _, pp_i, _ = _coords(par, rank - offset)
    tp_ranks = tuple(dist.get_process_group_ranks(groups["tp"]))
    per_stage = config.num_layers // par.pp
    with torch.device("meta"):
        model = GPT(config, tp=par.tp, layers=range(pp_i * per_stage, (pp_i + 1) * per_stage))
    model = model.to_empty(device="cpu").to(dtype)
    shapes, names = config.tensors(), model.canonical_names()
    holdings = []
    for local, param in model.named_parameters():
        name = names[local]
        layout = tp_layout(name, tp_ranks)
        fill_local(param, name, shapes[name], layout, rank, seed)
        placement = tp_placement(name)
        if declared:
            dim, stride = (placement.dim, placement.stride) if placement is not None else (None, 1)
            declare_layout(param, dim=dim, stride=stride, ranks=tp_ranks, name=name, shape=shapes[name])
        elif placement is not None:
            param.tensor_model_parallel = True
            param.partition_dim = placement.dim
            param.partition_stride = placement.stride
        holdings.append(Holding(param, name, shapes[name], layout))
    if not declared:
        model.pg_collection = SimpleNamespace(**groups)
    return model, holdings
