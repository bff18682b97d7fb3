"""Small model builders for tests and the demo: Megatron GPT, FSDP2 and DTensor-TP models.

Every builder is deterministic from ``seed`` and layout independent: the same logical weight has
the same values whatever the layout, so two layouts of one model can be compared element by
element. Values are a fixed function of the global element index (see ``coord_values``) plus a
per-weight constant taken from the model's own identity (global layer number, global expert index
as Megatron records them, relative param path), so a misplaced box or a swapped layer shows.

The builders that create process groups are collective: every rank of the world calls them with
the same arguments in the same order. Megatron and the FSDP/DTensor APIs are imported lazily.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..optional import require_megatron

__all__ = [
    "TinyMLP",
    "build_fsdp_mlp",
    "build_gpt",
    "build_pg_collection",
    "build_tp_mlp",
    "coord_values",
    "init_megatron",
    "salt",
]

_PHI = 0.6180339887498949
_PLASTIC = 0.7548776662466927


def coord_values(shape, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic tensor whose values depend on the element's global index, ``seed`` and ndim."""
    shape = tuple(int(s) for s in shape)
    idx = torch.arange(math.prod(shape), dtype=torch.float64)
    vals = torch.frac(idx * _PHI + (seed + 1) * _PLASTIC + len(shape) * 0.1) - 0.5
    return vals.to(dtype).reshape(shape)


def salt(key: str) -> float:
    """A per-weight constant in [-5, 5) derived from ``key``."""
    return (zlib.crc32(key.encode()) % 1000) / 100.0 - 5.0


# ---------------------------------------------------------------- Megatron-Core GPT


def init_megatron() -> None:
    """Initialise Megatron's global state once (``initialize_model_parallel(1)``), as its tests do."""
    require_megatron("reshard_core.testing.models.init_megatron")
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def build_pg_collection(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    *,
    rank_offset: int = 0,
    size: int | None = None,
    etp: int | None = None,
) -> Any:
    """A ``ProcessGroupCollection`` for TP×EP×PP×DP over ranks ``[rank_offset, rank_offset + size)``.

    Built like Megatron's refit tests: ``HyperCommGrid([tp, cp=1, ep, pp, dp])`` (TP fastest),
    ``expt_tp = tp`` and ``expt_dp = dp``; embedding groups from the first and last stage of every
    pipeline. ``etp``: an expert tensor-parallel size other than ``tp`` (Megatron's MoE with biases
    needs 1): the dense groups come from ``[tp, cp=1, pp, dp]`` and the expert groups from a grid of
    their own, ``[etp, ep, expert dp, pp]`` (expert TP fastest), as Megatron's ``parallel_state``
    lays them out. Collective over the world; ranks outside the grid get None.
    """
    require_megatron("reshard_core.testing.models.build_pg_collection")
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    size = dist.get_world_size() - rank_offset if size is None else size
    own_experts = etp is not None and etp != tp
    dense_ep = 1 if own_experts else ep
    if size % (tp * pp * dense_ep) or (own_experts and size % (etp * ep * pp)):
        raise ValueError(f"{size} ranks do not divide into tp={tp} x pp={pp} x ep={ep} (etp={etp})")
    dims = [tp, 1, dense_ep, pp, size // (tp * pp * dense_ep)]
    grid = HyperCommGrid(dims, ["tp", "cp", "ep", "pp", "dp"], rank_offset)
    names = {
        "tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "dp": "dp", "tp_cp": ["tp", "cp"],
        "mp": ["tp", "cp", "ep", "pp"], "tp_ep": ["tp", "ep"], "tp_ep_pp": ["tp", "ep", "pp"],
        "dp_cp": ["cp", "dp"], "tp_dp_cp": ["tp", "cp", "dp"],
    }  # fmt: skip
    groups = {key: grid.create_pg(dims) for key, dims in names.items()}
    experts = {"expt_tp": groups["tp"], "expt_dp": groups["dp"]}
    if own_experts:
        expert_dims = [etp, ep, size // (etp * ep * pp), pp]
        expert_grid = HyperCommGrid(expert_dims, ["tp", "ep", "dp", "pp"], rank_offset)
        for key, dims in (("ep", "ep"), ("tp_ep", ["tp", "ep"]), ("tp_ep_pp", ["tp", "ep", "pp"])):
            groups[key] = expert_grid.create_pg(dims)
        experts = {"expt_tp": expert_grid.create_pg("tp"), "expt_dp": expert_grid.create_pg("dp")}
    pp_enum = grid.get_rank_enum("pp")
    for key, pick in (("embd", parallel_state.default_embedding_ranks),
                      ("pos_embd", parallel_state.default_position_embedding_ranks)):  # fmt: skip
        groups[key], _ = dist.new_subgroups_by_enumeration([pick(r) for r in pp_enum])
    if groups["tp"] is None:
        return None
    return ProcessGroupCollection(**groups, **experts)


def build_gpt(
    pg_collection: Any,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 8,
    num_query_groups: int = 4,
    ffn_hidden_size: int = 128,
    vocab_size: int = 128,
    max_sequence_length: int = 16,
    num_moe_experts: int | None = None,
    gated: bool = True,
    bias: bool = True,
    tied: bool = False,
    expert_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    normalization: str = "LayerNorm",
    rope: bool = False,
    cpu_moe_forward: bool = False,
):
    """A Megatron-Core ``GPTModel`` (local layer spec, CPU init, ``dtype``) in ``pg_collection``'s layout.

    ``num_moe_experts`` makes every layer MoE with SequentialMLP experts (top-2 router).
    ``expert_bias`` adds the router's persistent ``expert_bias`` buffer (fp32, one per expert) by
    hand, since Megatron's own ``moe_router_enable_expert_bias`` allocates it on CUDA. ``tied``
    shares the output layer with the word embeddings: with PP1 there is no ``output_layer.weight``
    (with PP>1 the last stage holds its own, but Megatron's constructor then needs CUDA). MoE with
    TP>1 needs ``bias=False`` (Megatron supports MoE bias only with expert TP 1).
    ``parallel_output=False`` gathers the logits over TP (whole vocabulary on every rank).
    ``normalization="RMSNorm"`` and ``rope=True`` give a Llama-like model (no norm biases, no learned
    position embedding, SiLU gated MLPs). ``cpu_moe_forward`` builds MoE layers whose forward runs on
    CPU (allgather token dispatcher, since alltoall's creates a CUDA stream; no load-balancing loss);
    parameters are the same either way. Returns None when ``pg_collection`` is None (rank outside the grid).
    """
    if pg_collection is None:
        return None
    require_megatron("reshard_core.testing.models.build_gpt")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp, ep = (pg_collection.tp.size(), pg_collection.pp.size(), pg_collection.ep.size())
    init = lambda t: t.data.copy_(coord_values(t.shape, seed, t.dtype))  # noqa: E731
    extra = {}
    if normalization == "RMSNorm" and rope:
        extra["activation_func"] = torch.nn.functional.silu
    if num_moe_experts:
        extra |= dict(num_moe_experts=num_moe_experts, moe_ffn_hidden_size=ffn_hidden_size, moe_router_topk=2,
                     expert_model_parallel_size=ep, moe_grouped_gemm=False)  # fmt: skip
        if cpu_moe_forward:
            extra.update(moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                         moe_aux_loss_coeff=0.0)  # fmt: skip
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, ffn_hidden_size=ffn_hidden_size, gated_linear_unit=gated,
        add_bias_linear=bias, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, init_method=init,
        output_layer_init_method=init, embedding_init_method=init, normalization=normalization, **extra,
    )  # fmt: skip
    pp_rank = pg_collection.pp.rank()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=num_moe_experts, normalization=normalization
        ),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=tied,
        parallel_output=parallel_output,
        pg_collection=pg_collection,
        position_embedding_type="rope" if rope else "learned_absolute",
    )
    if expert_bias and num_moe_experts:
        for module in model.modules():
            if type(module).__name__ == "TopKRouter":
                del module.expert_bias  # a plain None attribute when the option is off
                module.register_buffer("expert_bias", torch.zeros(num_moe_experts, dtype=torch.float32))
    _set_megatron_values(model, seed)
    return model


def _set_megatron_values(model: nn.Module, seed: int) -> None:
    """Fill replicated tensors by ``coord_values`` (TP-split ones came from the full master weight
    through ``init_method``) and add each weight's salt, keyed by Megatron's own global identity."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    keys: dict[int, str] = {id(t): f"G|{n}" for n, t in _tensors(model)}
    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            keys.update({id(t): f"L{layer.layer_number}|{n}" for n, t in _tensors(layer)})
            for sub in layer.modules():
                if isinstance(sub, SequentialMLP):
                    for k, expert in enumerate(sub.local_experts):
                        key = f"L{layer.layer_number}|E{layer.mlp.local_expert_indices[k]}"
                        keys.update({id(t): f"{key}|{n}" for n, t in _tensors(expert)})
    pgs = model.pg_collection
    with torch.no_grad():
        for _, t in _tensors(model):
            if not t.is_floating_point():
                continue
            if not getattr(t, "tensor_model_parallel", False):
                t.copy_(coord_values(t.shape, seed, t.dtype))
            elif t.dim() == 1:  # Megatron zero-fills TP-split biases: give them telling values
                group = pgs.expt_tp if getattr(t, "allreduce", True) is False else pgs.tp
                t.copy_(
                    _megatron_shard(
                        coord_values((t.numel() * group.size(),), seed, t.dtype),
                        group.size(),
                        group.rank(),
                        getattr(t, "partition_stride", 1),
                    )
                )
            t.add_(salt(keys[id(t)]))


def _megatron_shard(full: torch.Tensor, width: int, index: int, stride: int) -> torch.Tensor:
    """TP rank ``index``'s part of ``full`` (dim 0) as Megatron splits it: ``full`` cut into
    ``width * stride`` equal chunks, the rank holding chunks ``index, index + width, ...``."""
    chunks = full.chunk(width * stride)
    return torch.cat([chunks[index + k * width] for k in range(stride)])


def _tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


# ---------------------------------------------------------------- FSDP2 and DTensor TP


class TinyMLP(nn.Module):
    """``fc1`` (hidden → ffn), ``fc2`` (ffn → hidden) and a persistent ``scale`` buffer."""

    def __init__(self, hidden: int = 64, ffn: int = 33, seed: int = 0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.register_buffer("scale", torch.ones(hidden))
        with torch.no_grad():
            for name, t in _tensors(self):
                t.copy_(coord_values(t.shape, seed, t.dtype) + salt(name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def build_fsdp_mlp(mesh=None, *, seed: int = 0, hidden: int = 64, ffn: int = 33) -> TinyMLP:
    """``TinyMLP`` under FSDP2 ``fully_shard`` (each Linear, then the root) on ``mesh``.

    ``mesh`` defaults to a 1-d CPU mesh over the world; a 2-d mesh gives HSDP (replicate, shard).
    With ``ffn=33`` on 2 ranks ``fc1.weight`` (33, 64) shards unevenly (17 + 16 rows).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    model = TinyMLP(hidden, ffn, seed)
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_tp_mlp(mesh, *, seed: int = 0, hidden: int = 64, ffn: int = 96, fsdp_mesh=None) -> TinyMLP:
    """``TinyMLP`` with ``parallelize_module``: ``fc1`` colwise, ``fc2`` rowwise over ``mesh``.

    With ``fsdp_mesh`` (the other dim of a 2-d mesh) the TP model is then ``fully_shard``-ed over
    it, which gives ``fc1.weight`` the placements ``(_StridedShard(0), Shard(0))``.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = TinyMLP(hidden, ffn, seed)
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if fsdp_mesh is not None:
        fully_shard(model.fc1, mesh=fsdp_mesh)
        fully_shard(model.fc2, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model
