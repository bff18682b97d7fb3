"""vLLM's own weight loader as the oracle of format "vllm": a vLLM model built in this process (no
engine), filled from an HF checkpoint by vLLM's ``load_weights`` and read back through the format.

``loaded_problems(rank, world, model_dir)`` is a world job (``run_world``; the world's size is the
TP size): each rank builds the vLLM model of ``model_dir`` with vLLM's process groups over this
world, loads the checkpoint with vLLM's loader, and compares every logical tensor the format reads
on this rank with the checkpoint's region its layout names, and every padding view with zeros.
Returns this rank's problems (empty when the format and vLLM's loader agree bit for bit) and how
many elements it compared.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch


def build_vllm_model(model_dir: str, tp: int, rank: int, dtype: str = "float32") -> tuple[Any, Any]:
    """vLLM's model of ``model_dir`` for TP rank ``rank`` of ``tp`` (the world is this job's),
    before any weight is loaded; and its vLLM config."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # names the CPU communicator's shared memory: the same on every rank of this world, new per world
    os.environ["VLLM_DIST_IDENT"] = f"reshard-{zlib.crc32(model_dir.encode())}-{tp}"
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    args = EngineArgs(
        model=model_dir, skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
        tensor_parallel_size=tp, distributed_executor_backend="mp", dtype=dtype,
    )  # fmt: skip
    vllm_config = args.create_engine_config()
    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo")
    with set_current_vllm_config(vllm_config):
        initialize_model_parallel(tp, 1)
        torch.set_default_dtype(vllm_config.model_config.dtype)
        try:
            model = initialize_model(vllm_config)
        finally:
            torch.set_default_dtype(torch.float32)
    return model, vllm_config


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as saved (per expert, except GPT-OSS's fused experts)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    return out


def logical(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under their logical names: GPT-OSS's fused experts (``gate_up_proj
    [E, H, 2I]``, gate the even columns, ``down_proj [E, I, H]``, their biases) per expert, transposed
    to ``[out, in]``, written from the GPT-OSS model card's layout, not from reshard's code."""
    out = {}
    for name, t in weights.items():
        prefix, _, last = name.rpartition(".experts.")
        where = f"{prefix}.experts."
        if last == "gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{where}{e}.gate_proj.weight"] = t[e, :, 0::2].t()
                out[f"{where}{e}.up_proj.weight"] = t[e, :, 1::2].t()
        elif last == "gate_up_proj_bias":
            for e in range(t.shape[0]):
                out[f"{where}{e}.gate_proj.bias"], out[f"{where}{e}.up_proj.bias"] = t[e, 0::2], t[e, 1::2]
        elif last == "down_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{where}{e}.down_proj.weight"] = t[e].t()
        elif last == "down_proj_bias":
            for e in range(t.shape[0]):
                out[f"{where}{e}.down_proj.bias"] = t[e]
        else:
            out[name] = t
    return out


def loaded_problems(rank: int, world: int, model_dir: str, dtype: str = "float32") -> tuple[list[str], int]:
    from vllm.config import set_current_vllm_config

    from reshard_core.extract import ExtractContext
    from reshard_core.formats import VLLMFormat, VLLMParallel, declare_vllm

    model, vllm_config = build_vllm_model(model_dir, world, rank, dtype)
    saved = checkpoint(model_dir)
    with set_current_vllm_config(vllm_config):
        model.load_weights(saved.items())
    weights = logical(saved)
    declare_vllm(model, VLLMParallel.of(range(world)))
    found = VLLMFormat().logical_specs(model, "dst", ExtractContext(rank=rank, world=world))
    problems = [f"unmapped: {name}" for name in found.unmapped]
    problems += [f"padding not zero: {tuple(p.shape)}" for p in found.padding if bool((p != 0).any())]
    compared = 0
    for spec in found.specs:
        name, shape = spec.meta.name, tuple(spec.meta.shape)
        want = weights.get(name)
        if want is None:
            problems.append(f"{name}: not in the checkpoint")
            continue
        if tuple(want.shape) != shape:
            problems.append(f"{name}: the format says {shape}, the checkpoint holds {tuple(want.shape)}")
            continue
        for box in spec.layout.boxes(shape, rank):
            local = spec.tensor[_slices(box.local_offsets, box.sizes)]
            region = want.to(local.dtype)[_slices(box.offsets, box.sizes)]
            if not torch.equal(local, region):
                problems.append(
                    f"{name}: rank {rank}'s {box.sizes} at {box.offsets} differs from the checkpoint"
                )
            compared += box.numel
    return problems, compared


def _slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
