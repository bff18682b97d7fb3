"""Trainer jobs that refit a running vLLM engine of one family (``tiny.KINDS``) through reshard-vllm.

``fsdp_rounds`` runs as a separate job (``run_world``: its own processes and Gloo world): an FSDP2
transformers model of the family, sharded over the job's ranks, refits the engine at ``url`` round by
round. A round is ``(seed, fault)``: the trainer's weights become ``tiny.hf_model(kind, seed)``'s
(the test builds the same model as its reference), and when ``fault`` names a worker call ("update"
or "finish", see ``tests/vllm/fault_injection.py``) that call is armed to fail on engine worker 1
first, so the update must fail on every trainer rank and leave the engine as it was. After each
round rank 0 asks the engine for a greedy completion. Returns on rank 0, per round, ``(outcome,
tokens, logprobs, {engine rank: (bytes received, bytes expected)})``; ``outcome`` is "ok" or the
error every rank raised (the ranks' texts must agree).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]
NEW_TOKENS = 8


def fsdp_model(kind: str, seed: int) -> Any:
    """The family's transformers model of ``seed``, FSDP2-sharded over this job's ranks (per layer)."""
    import tiny
    from torch.distributed.fsdp import fully_shard

    model = tiny.hf_model(kind, seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def load(model: Any, kind: str, seed: int) -> None:
    """Set the FSDP2 ``model``'s weights and buffers to ``tiny.hf_model(kind, seed)``'s (collective)."""
    import tiny
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = tiny.hf_model(kind, seed)
    values = dict(full.named_parameters()) | dict(full.named_buffers())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if isinstance(tensor, DTensor):
                tensor.copy_(distribute_tensor(values[name].detach(), tensor.device_mesh, tensor.placements))
            else:
                tensor.copy_(values[name])


def trainer(rank: int, world: int, url: str, model: Any, port: int = 0, timeout: float = 60.0) -> Any:
    """``trainer_init`` on this rank; ``port`` 0: rank 0 picks a free one and tells the others."""
    from reshard_vllm import ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from reshard_core.testing.world import free_port

    box = [port or (free_port() if rank == 0 else 0)]
    dist.broadcast_object_list(box, src=0)
    info = ReshardTrainerInitInfo("127.0.0.1", box[0], world, rank=rank, timeout=timeout)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
    )


def fsdp_rounds(
    rank: int, world: int, url: str, model_dir: str, kind: str, rounds: list[tuple[int, str]]
) -> Any:
    import tiny
    from vllm_harness import completions, post_json

    from reshard_core.testing.world import outcome

    model = fsdp_model(kind, rounds[0][0])
    engine = trainer(rank, world, url, model)
    options = tiny.SEND_OPTIONS.get(kind, {})
    out = []
    for seed, fault in rounds:
        load(model, kind, seed)
        if fault and rank == 0:
            post_json(url + "/collective_rpc", {"method": "reshard_arm_fault", "args": [fault, "1"]})
        dist.barrier()
        version = f"{kind}-{seed}-{fault}" if fault else f"{kind}-{seed}"
        result = outcome(lambda version=version: engine.send_weights(version=version, **options))
        texts: list[Any] = [None] * world
        dist.all_gather_object(texts, result)
        dist.barrier()
        if rank == 0:
            assert len(set(texts)) == 1, f"the trainer ranks disagree: {texts}"
            tokens, logprobs = completions(url, model_dir, PROMPT, NEW_TOKENS)
            received = dict(engine.last.received) if result == "ok" else {}
            out.append((result, tokens, logprobs, received))
    engine.shutdown()
    return out if rank == 0 else None


def megatron_rounds(rank: int, world: int, url: str, model_dir: str, kind: str, seeds: list[int]) -> Any:
    """A Megatron-Core job (TP2·EP2 over its four ranks, ``megatron_families.build``) refits the
    engine round by round: each round its parameters become the conversion of ``tiny.hf_model(kind,
    seed)`` (``megatron_families.expected``), sent shard to shard. Returns on rank 0, per round,
    ``(tokens, logprobs, {engine rank: (bytes received, bytes expected)})``."""
    import megatron_families as M
    import tiny
    from vllm_harness import completions

    M.cpu_stand_ins()
    model = M.build(kind, tp=2, ep=2)
    engine = trainer(rank, world, url, model)
    out = []
    for seed in seeds:
        hf = tiny.hf_model(kind, seed)
        named = [*hf.named_parameters(), *hf.named_buffers()]
        tensors = {n: t.detach() for n, t in named if "rotary" not in n}
        want = M.expected(model, M.logical_of(tensors, kind), kind)
        with torch.no_grad():
            for name, tensor in M.weights(model).items():
                tensor.copy_(want[name])
        verdict = engine.send_weights(version=f"{kind}-megatron-{seed}")
        dist.barrier()
        if rank == 0:
            out.append((*completions(url, model_dir, PROMPT, NEW_TOKENS), dict(verdict.received)))
    engine.shutdown()
    return out if rank == 0 else None
