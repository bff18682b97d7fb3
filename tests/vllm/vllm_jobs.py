"""Trainer jobs for the vLLM tests: each runs as a separate job (own processes, own Gloo world,
``reshard_core.testing.world.run_world``) and refits a running vLLM engine through reshard-vllm.

A job gets the engine's URL (a server) and the transfer group's port (0: rank 0 picks one). Round
``k`` sets the trainer's weights to ``model_for(config, seeds[k])`` (the test builds the same model as its
reference), sends them, and has rank 0 ask the server for a greedy completion. Returns, per round,
``(tokens, logprobs, {engine rank: (bytes received, bytes expected)})`` on rank 0, None elsewhere.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]
NEW_TOKENS = 8
SEEDS = [11, 12, 13]
DTYPE = "float32"
"""Engines and trainers run in float32: vLLM's CPU kernels then agree with transformers' logprobs
to ~1e-5 (MoE ~2e-4; bf16 ~0.05), so ``LOGPROB_ATOL`` can be tight while any misplaced slice shows."""
LOGPROB_ATOL = 1e-3
INIT_STD = 0.02
"""Weights drawn from N(0, 0.02): vLLM's CPU attention then agrees with transformers to ~1e-5 in
float32 (at 0.2 it drifts to ~3e-2), while a misplaced slice moves logprobs by 4e-2 or more."""


def model_for(config: Any, seed: int) -> Any:
    """The transformers model of round ``seed``: what the trainer sends and the test's reference."""
    from vllm_harness import tiny_model

    return tiny_model(config, seed=seed, init_std=INIT_STD)


def _engine(
    rank: int, world: int, url: str, port: int, model: Any, timeout: float = 60.0, transport: str = "gloo"
) -> Any:
    """``trainer_init`` on this rank over ``transport``; ``port`` 0: rank 0 picks a free one (after
    this job's own world took its port, so the two never collide) and tells the others."""
    from reshard_vllm import ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from reshard_core.testing.world import free_port

    if not port:
        box = [free_port() if rank == 0 else 0]
        dist.broadcast_object_list(box, src=0)
        port = box[0]

    info = ReshardTrainerInitInfo("127.0.0.1", port, world, rank=rank, timeout=timeout, transport=transport)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
    )


def _round(engine: Any, rank: int, url: str, model_dir: str, delta: bool = False) -> Any:
    from vllm_harness import completions

    verdict = engine.send_weights(version=None, delta=delta)
    dist.barrier()
    if rank != 0:
        return None
    tokens, logprobs = completions(url, model_dir, PROMPT, NEW_TOKENS)
    return tokens, logprobs, dict(verdict.received)


def hf_fsdp_job(
    rank: int, world: int, url: str, model_dir: str, port: int, kind: str, seeds: list[int],
    transport: str = "gloo", delta: bool = False,
) -> Any:  # fmt: skip
    """An FSDP2 transformers model (``kind``: "llama" or "qwen3_moe") sharded over this job's ranks,
    sent over ``transport`` (with ``delta``: only what changed, after the first round)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    config = _config(kind)
    model = model_for(config, seeds[0])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = _engine(rank, world, url, port, model, transport=transport)
    out = []
    for seed in seeds:
        full = model_for(config, seed).state_dict()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(distribute_tensor(full[name], param.device_mesh, param.placements))
        out.append(_round(engine, rank, url, model_dir, delta))
    engine.shutdown()
    return out


def megatron_job(
    rank: int, world: int, url: str, model_dir: str, port: int, kind: str, seeds: list[int], tp: int, ep: int,
    transport: str = "gloo",
) -> Any:  # fmt: skip
    """A Megatron-Core ``GPTModel`` (TP ``tp``, EP ``ep``) holding ``model_for(config, seed)``'s weights:
    each round refits the transformers model into it inside this job (reshard, bit-exact), then into
    the engine."""
    import reshard_core
    from reshard_core.testing.models import init_megatron

    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed)\.")
    init_megatron()
    config = _config(kind)
    gpt = _build_gpt(config, tp=tp, ep=ep)
    engine = _engine(rank, world, url, port, gpt, transport=transport)
    out = []
    for seed in seeds:
        reshard_core.refit(model_for(config, seed), gpt)  # HF -> Megatron within this job
        out.append(_round(engine, rank, url, model_dir))
    engine.shutdown()
    return out


def failing_job(rank: int, world: int, url: str, model_dir: str, port: int, case: str, out: str = "") -> Any:
    """One bad update against a running engine; returns each rank's error text (or "ok"), and rank 0
    also writes it to ``out`` (when given: a job whose rank dies returns nothing)."""
    try:
        text = _failing(rank, world, url, port, case)
    except Exception as exc:  # not a ReshardError: written down for the test to show
        text = f"{type(exc).__name__}: {exc}"
    if out and rank == 0:
        with open(out, "w") as f:
            f.write(text)
    return text


def _failing(rank: int, world: int, url: str, port: int, case: str) -> str:
    from vllm_harness import tiny_llama_config

    from reshard_core.testing.world import outcome

    if case == "mismatch":  # another model: 3 layers, hidden 96, vocab 640
        config = tiny_llama_config(
            num_hidden_layers=3, hidden_size=96, vocab_size=640, head_dim=24, dtype=DTYPE
        )
        model = model_for(config, 99)
        for layer in model.model.layers:
            from torch.distributed.fsdp import fully_shard

            fully_shard(layer)
        engine = _engine(rank, world, url, port, model, timeout=10)
        return outcome(lambda: engine.send_weights())
    if case == "dies":  # rank 1 exits while the others send
        model = model_for(_config("llama"), 98)
        engine = _engine(rank, world, url, port, model, timeout=10)
        if rank == 1:
            os._exit(3)
        return outcome(lambda: engine.send_weights())
    raise ValueError(case)


def check_rounds(
    rounds: list, kind: str = "llama", workers: tuple[int, ...] = (2, 3), exact_bytes: bool = True
) -> None:
    """Each round agrees with transformers on its seed's weights, differs from the one before, and
    every engine worker received exactly the bytes of its own parameters (with ``exact_bytes=False``,
    delta rounds: the first round exactly, later ones some and at most that)."""
    from vllm_harness import check_greedy

    config = _config(kind)
    previous = None
    for index, (seed, (tokens, logprobs, received)) in enumerate(zip(SEEDS, rounds, strict=True)):
        check = check_greedy(
            model_for(config, seed),
            PROMPT,
            tokens,
            logprobs,
            logprob_atol=LOGPROB_ATOL,
            tie_atol=LOGPROB_ATOL,
        )
        assert check.ok, f"seed {seed}: {check}"
        assert len(tokens) == NEW_TOKENS and tokens != previous
        previous = tokens
        assert sorted(received) == list(workers)  # the engine's workers, after the trainer's ranks 0, 1
        for rank, (got, expected) in received.items():
            if exact_bytes or index == 0:
                assert got == expected > 0, f"engine rank {rank} received {got} bytes, holds {expected}"
            else:
                assert 0 < got <= expected, f"engine rank {rank} received {got} bytes, holds {expected}"


@contextmanager
def served(path: Any, kind: str, tp: int, **options: Any) -> Iterator[Any]:
    """A running ``vllm serve`` of the tiny ``kind`` model (dummy weights, ``DTYPE``) at TP ``tp``
    with backend "reshard"; stopped (every process of it) on exit. ``options``: more of
    ``VLLMServer``'s (``extra_args``, ``env``)."""
    from vllm_harness import VLLMServer, write_model_dir

    model_dir = write_model_dir(path, _config(kind))
    with VLLMServer(
        model_dir, tp=tp, weight_transfer_backend="reshard", startup_timeout=600, dtype=DTYPE, **options
    ) as server:
        print(f"{kind} server at TP{tp} started in {server.startup_seconds:.1f} s")
        yield server


def _config(kind: str) -> Any:
    from vllm_harness import tiny_llama_config, tiny_qwen3_moe_config

    make = tiny_llama_config if kind == "llama" else tiny_qwen3_moe_config
    return make(dtype=DTYPE)


def _build_gpt(config: Any, *, tp: int, ep: int) -> Any:
    """A Megatron-Core GPTModel (local spec) with ``config``'s shapes: RMSNorm, RoPE, gated SiLU,
    GQA, untied embeddings, ``DTYPE``; Qwen3-MoE configs get q/k norms and routed experts."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard_core.testing.models import build_pg_collection

    moe = getattr(config, "num_experts", None)
    extra = {}
    if moe:
        extra = dict(
            num_moe_experts=moe, moe_ffn_hidden_size=config.moe_intermediate_size,
            moe_router_topk=config.num_experts_per_tok, expert_model_parallel_size=ep,
            moe_grouped_gemm=False, moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather", qk_layernorm=True,
        )  # fmt: skip
    tc = TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim, ffn_hidden_size=config.intermediate_size, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=getattr(torch, DTYPE),
        hidden_dropout=0.0, attention_dropout=0.0, **extra,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        num_experts=moe or None, moe_grouped_gemm=False, qk_layernorm=bool(moe), normalization="RMSNorm"
    )
    return GPTModel(
        config=tc, transformer_layer_spec=spec, vocab_size=config.vocab_size, max_sequence_length=128,
        position_embedding_type="rope", rotary_base=int(getattr(config, "rope_theta", 10000)),
        share_embeddings_and_output_weights=False, pg_collection=build_pg_collection(tp=tp, ep=ep),
    )  # fmt: skip


def cast_job(rank: int, world: int, url: str, model_dir: str, seed: int) -> Any:
    """A bfloat16 FSDP2 trainer refits the float32 engine: first without ``cast`` (refused), then
    with ``cast=True``. Returns each rank's two outcomes, and on rank 0 the engine's greedy answer
    before and after each."""
    from torch.distributed.fsdp import fully_shard
    from vllm_harness import completions

    from reshard_core.testing.world import outcome

    model = model_for(_config("llama"), seed).to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = _engine(rank, world, url, 0, model)
    answers = [completions(url, model_dir, PROMPT, NEW_TOKENS) if rank == 0 else None]
    outcomes = []
    for cast in (False, True):
        outcomes.append(outcome(lambda cast=cast: engine.send_weights(cast=cast)))
        dist.barrier()
        answers.append(completions(url, model_dir, PROMPT, NEW_TOKENS) if rank == 0 else None)
    engine.shutdown()
    return outcomes, answers
