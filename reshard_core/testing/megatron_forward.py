"""Run a Megatron-Core ``GPTModel``'s forward on CPU (over Gloo) and return its logits on every rank.

Megatron's forward assumes CUDA in two places a CPU run reaches: ``torch.cuda.current_device()``
and the CUDA RNG tracker's ``fork()``; MoE layers also reference ``moe_utils.te_general_gemm``, which
0.16.1 leaves undefined without Transformer Engine. ``allow_cpu_forward()`` stubs all three for this
process (call it once per process, before the first forward). ``gpt_logits`` runs a whole pipeline
by hand: stage 0 embeds the tokens, each stage sends its hidden states to the next stage of its
pipeline group, the last stage computes the logits, which are then broadcast over the pipeline
group. MoE models must be built with the allgather token dispatcher (``build_gpt(...,
cpu_moe_forward=True)``; the alltoall one creates a CUDA stream) and run with a causal mask.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ..optional import require_megatron


def allow_cpu_forward() -> None:
    """Stub the CUDA and Transformer Engine references Megatron's local-spec forward makes, for this
    process."""
    require_megatron("reshard_core.testing.megatron_forward.allow_cpu_forward")
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None


def gpt_inputs(
    batch: int, seq_len: int, vocab_size: int, seed: int = 0, *, causal: bool = False
) -> tuple[torch.Tensor, ...]:
    """``(tokens, position_ids, attention_mask)``: random tokens from ``seed``; the mask (True = masked)
    is all true, or with ``causal`` true above the diagonal only."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)
    positions = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
    mask = torch.ones((batch, 1, seq_len, seq_len), dtype=torch.bool)
    if causal:
        mask = torch.triu(mask, diagonal=1)
    return tokens, positions, mask


@torch.no_grad()
def gpt_logits(model: Any, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` of ``model`` (built with ``parallel_output=False``) on every rank
    of its pipeline group, the model in eval mode (MoE with TP>1 refuses a training forward without
    sequence parallelism; its training mode is restored). Collective over the model's pipeline and
    tensor-parallel groups."""
    pgs = model.pg_collection
    stages = dist.get_process_group_ranks(pgs.pp)
    stage = pgs.pp.rank()
    batch, seq = tokens.shape
    hidden = model.config.hidden_size
    if stage > 0:
        received = torch.empty(seq, batch, hidden, dtype=model.config.params_dtype)
        dist.recv(received, src=stages[stage - 1])
        model.set_input_tensor(received)
    training = model.training
    model.eval()
    try:
        out = model(tokens, positions, mask)
    finally:
        model.train(training)
    if stage < len(stages) - 1:
        dist.send(out.contiguous(), dst=stages[stage + 1])
        out = torch.empty(batch, seq, model.vocab_size, dtype=torch.float32)
    else:
        out = out.float().contiguous()
    dist.broadcast(out, src=stages[-1], group=pgs.pp)
    return out
