"""vLLM refit benchmark: reshard's shard-to-shard update against the gather-first path, same engine, same run.

    python benchmarks/bench_vllm.py [--tp 2] [--hidden 1024] [--layers 4] [--vocab 16384] [--reps 3]
                                    [--transports gloo ipc]

One offline ``vllm.LLM`` (CPU, bf16, backend "reshard", TP ``--tp``) and a 1-rank trainer in this
process holding the transformers Llama. Per update, every path moves the same new weights into the
same engine:

- **reshard gloo**, **reshard ipc** (each of ``--transports``, in turn; each ``trainer_init`` takes the
  engine over from the one before): ``send_weights()``: each worker receives only the slices of its
  own checkpoint-layout parameters, straight into them, then vLLM re-processes its layers;
- **gather-first** (what other stacks do; over the first transport's Gloo group): the trainer's
  full tensors (a trainer that shards them would all-gather them first; this one holds them whole,
  which favours this path) are broadcast to every worker, which applies them with the model's
  ``load_weights`` inside vLLM's layerwise reload.

Prints seconds per update (median of ``--reps``) and bytes each worker received, for every path,
and the ratios. Each update's greedy output is checked against transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))  # vllm_harness

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]


def gather_first_worker(worker, names: list[str], shapes: list[list[int]], dtype: str) -> int:
    """On every worker (``collective_rpc``): receive every full tensor from the trainer (transfer
    group rank 0) and apply them with ``load_weights`` inside a layerwise reload. Returns bytes."""
    import torch.distributed as dist
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    engine = worker.weight_transfer_engine
    model, pg = engine.model, engine.group.pg
    received = 0

    def tensors():
        nonlocal received
        for name, shape in zip(names, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, group=pg, group_src=0)
            received += t.numel() * t.element_size()
            yield name, t

    initialize_layerwise_reload(model)
    try:
        model.load_weights(tensors())
    finally:
        finalize_layerwise_reload(model, engine.model_config)
    return received


def gather_first_update(llm, trainer_engine, model) -> tuple[float, list[int]]:
    """One gather-first update; returns (seconds, bytes each worker received)."""
    import threading

    import torch.distributed as dist

    state = {n: p.detach() for n, p in model.named_parameters()}
    names, shapes = list(state), [list(t.shape) for t in state.values()]
    dtype = str(next(iter(state.values())).dtype).split(".")[-1]
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    rpc = threading.Thread(
        target=lambda: out.setdefault(
            "bytes", llm.collective_rpc(gather_first_worker, args=(names, shapes, dtype))
        )
    )
    rpc.start()
    for t in state.values():
        dist.broadcast(t.contiguous(), group=trainer_engine.group.pg, group_src=0)
    rpc.join()
    return time.perf_counter() - start, out["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["gloo", "ipc"],
                        help="transports to refit over, in turn (gather-first with the first)")  # fmt: skip
    args = parser.parse_args()

    import vllm_harness as T
    from reshard_vllm import LLMClient, ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from reshard_core.testing.world import free_port

    config = T.tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.tp, args.hidden // 256), head_dim=64, vocab_size=args.vocab,
    )  # fmt: skip
    model = T.tiny_model(config, seed=0)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}"
    print(f"model: {size / 2**20:.1f} MiB bf16, {shape}; engine TP{args.tp} on CPU (Gloo)")
    import tempfile

    t0 = time.perf_counter()
    llm = T.offline_llm(
        T.write_model_dir(tempfile.mkdtemp(prefix="bench-vllm-"), config), tp=args.tp,
        weight_transfer_config={"backend": "reshard"},
    )  # fmt: skip
    print(f"engine built in {time.perf_counter() - t0:.1f} s")
    results: dict[str, list[tuple[float, list[int]]]] = {}
    try:
        for transport in args.transports:  # each trainer_init takes the engine over from the one before
            port = free_port()
            info = ReshardTrainerInitInfo("127.0.0.1", port, 1, rank=0, timeout=300, transport=transport)
            engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=model)
            paths = [f"reshard {transport}"] + (["gather-first"] if transport == args.transports[0] else [])
            for rep in range(args.reps + 1):  # the first of each warms up (plans, buffers)
                for path in paths:
                    model.load_state_dict(T.tiny_model(config, seed=100 + rep).state_dict())
                    if path.startswith("reshard"):
                        verdict = engine.send_weights()
                        got = (verdict.seconds, [verdict.received[r][0] for r in sorted(verdict.received)])
                    else:
                        got = gather_first_update(llm, engine, model)
                    tokens, logprobs = T.llm_greedy(llm, PROMPT, 8)
                    check = T.check_greedy(model, PROMPT, tokens, logprobs, logprob_atol=0.15)
                    if not check.ok:
                        raise SystemExit(f"{path} update {rep}: the engine does not match the trainer: "
                                         f"{check}")  # fmt: skip
                    if rep:
                        results.setdefault(path, []).append(got)
                    print(f"  {path:14} update {rep}{' (warm-up)' if not rep else ''}: {got[0]:.3f} s, "
                          f"worker bytes {[f'{b / 2**20:.1f} MiB' for b in got[1]]}", flush=True)  # fmt: skip
            engine.shutdown()
    finally:
        T.shutdown_llm(llm)
    med = {p: statistics.median(s for s, _ in r) for p, r in results.items()}
    per_worker = {p: r[0][1] for p, r in results.items()}
    print(f"\nper update (median of {args.reps}), engine TP{args.tp}:")
    print(f"  {'path':14} {'seconds':>8} {'MiB per worker':>16}")
    for p in results:
        print(f"  {p:14} {med[p]:8.3f} {' / '.join(f'{b / 2**20:.1f}' for b in per_worker[p]):>16}")
    first = f"reshard {args.transports[0]}"
    print(f"  gather-first / {first}: {med['gather-first'] / med[first]:.2f}x time, "
          f"{sum(per_worker['gather-first']) / sum(per_worker[first]):.2f}x bytes")  # fmt: skip
    for transport in args.transports[1:]:
        print(f"  {first} / reshard {transport}: {med[first] / med[f'reshard {transport}']:.2f}x time")


if __name__ == "__main__":
    main()
