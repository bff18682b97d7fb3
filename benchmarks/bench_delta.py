"""Delta refits on real RL-style updates: what changes per step, what moves, what it costs.

    python benchmarks/bench_delta.py [--steps 4] [--lrs 1e-6,1e-5,1e-4] [--hidden 512] [--layers 4]
                                     [--vocab 8192] [--no-vllm] [--json]

Trainers hold FP32 master weights and a BF16 model copy; each step ``torch.optim.AdamW`` updates
the masters with random gradients and the copy is refreshed from them (weights start at N(0, 0.02),
norms at 1, as in a transformers init). Two pairs, each in a 2-rank Gloo world on loopback:

- **megatron**: Megatron-Core ``GPTModel`` TP2 → ``GPTModel`` TP1 on both ranks (DP2);
- **hf**: ``LlamaForCausalLM`` under FSDP2 → ``LlamaForCausalLM`` replicated on both ranks.

Per learning rate, fresh models and two prepared sessions on the same source: ``delta=True`` into
the destination and a plain one into a twin; after each step both refit (``Session.refit()``), each
timed as the slowest rank's seconds from a common barrier. Prints, over the steps after the first
(which is full for both): the share of BF16 elements that changed, bytes sent (delta / full), bytes
per changed element, time (delta / full, median of steps) and the snapshot memory the senders keep
(against the model's bytes). Checks afterwards that the destination equals the twin bit for bit.

With ``reshard-vllm`` and vLLM installed (and without ``--no-vllm``), the same for an offline
``vllm.LLM`` (TP1, CPU, bf16) refit by a 1-rank trainer in this process: per learning rate,
``--steps`` delta updates, then ``--steps`` plain ones (a plain update rewrites the engine's
buffers, so the two cannot alternate), each timed end to end (``send_weights``, vLLM's re-processing
of every layer included). No assertions on time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from reshard_core.testing.training import MasterWeights
from reshard_core.testing.world import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))  # vllm_harness

BF16 = torch.bfloat16


def _init_like_hf(model: torch.nn.Module, seed: int) -> None:
    """Matrices N(0, 0.02), vectors (norms) 1: the magnitudes a real checkpoint has."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = getattr(p, "_local_tensor", p)
            if local.dim() >= 2:
                local.copy_(torch.randn(local.shape, generator=gen) * 0.02)
            else:
                local.fill_(1.0)


def _llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["hidden"] * 3,
        num_hidden_layers=args["layers"], num_attention_heads=args["hidden"] // 64, num_key_value_heads=4,
        head_dim=64, tie_word_embeddings=False, max_position_embeddings=64,
    )  # fmt: skip


def _models(pair: str, args: dict) -> tuple:
    """(source, destination, twin) of ``pair`` on this rank."""
    if pair == "megatron":
        from megatron.core import tensor_parallel

        from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

        init_megatron()
        torch.cuda.current_device = lambda: "cpu"
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        shape = dict(
            num_layers=args["layers"], hidden_size=args["hidden"], num_attention_heads=args["hidden"] // 64,
            num_query_groups=4, ffn_hidden_size=args["hidden"] * 3, vocab_size=args["vocab"], dtype=BF16,
            normalization="RMSNorm", rope=True, bias=False,
        )  # fmt: skip
        return tuple(build_gpt(build_pg_collection(tp=tp), **shape) for tp in (2, 1, 1))
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    config = _llama_config(args)
    src = LlamaForCausalLM(config).to(BF16)
    for layer in src.model.layers:
        fully_shard(layer)
    fully_shard(src)
    return src, LlamaForCausalLM(config).to(BF16), LlamaForCausalLM(config).to(BF16)


def _timed(call) -> tuple[float, object]:
    """The slowest rank's seconds for ``call()``, from a common barrier."""
    dist.barrier()
    start = time.perf_counter()
    out = call()
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), out


def _sum(values: list[float]) -> float:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def bench_rank(rank: int, world: int, pair: str, args: dict) -> list[dict]:
    import reshard_core

    rows = []
    for lr in args["lrs"]:
        src, dst, twin = _models(pair, args)
        _init_like_hf(src, seed=rank)
        trainer = MasterWeights(src, lr, seed=100 + rank)
        delta = reshard_core.prepare(src, dst, delta=True)
        plain = reshard_core.prepare(src, twin)
        delta.refit(), plain.refit()  # the first is full for both
        steps = []
        for _ in range(args["steps"]):
            trainer.step()
            t_delta, r_delta = _timed(delta.refit)
            t_plain, r_plain = _timed(plain.refit)
            d = r_delta.delta
            sent_delta, sent_plain, changed, compared = _sum(
                [r_delta.bytes_sent, r_plain.bytes_sent, d.changed_words, d.compared_words]
            )
            steps.append((t_delta, t_plain, sent_delta, sent_plain, changed, compared))
        model_bytes = sum(getattr(p, "_local_tensor", p).nbytes for p in src.parameters())
        held, model_bytes = _sum([r_delta.delta.held_bytes, model_bytes])
        wrong = [n for (n, a), b in zip(dst.named_parameters(), twin.parameters(), strict=True)
                 if not torch.equal(_bits(a), _bits(b))]  # fmt: skip
        rows.append(_row(pair, lr, steps, held, model_bytes, wrong))
        reshard_core.clear_caches()
    return rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _row(pair: str, lr: float, steps: list[tuple], held: float, model_bytes: float, wrong: list) -> dict:
    t_delta, t_plain, sent_delta, sent_plain, changed, compared = (list(c) for c in zip(*steps, strict=True))
    return dict(
        pair=pair, lr=lr, changed=sum(changed) / max(sum(compared), 1),
        bytes_ratio=sum(sent_delta) / max(sum(sent_plain), 1),
        bytes_per_changed=sum(sent_delta) / max(sum(changed), 1),
        time_ratio=statistics.median(a / b for a, b in zip(t_delta, t_plain, strict=True)),
        seconds_delta=statistics.median(t_delta), seconds_plain=statistics.median(t_plain),
        held_bytes=held, model_bytes=model_bytes, exact=not wrong,
    )  # fmt: skip


def bench_vllm(args: dict) -> list[dict]:
    """The offline-engine rows (see the module docstring); [] when vLLM or reshard-vllm is missing."""
    try:
        import tempfile

        import vllm_harness as T
        from reshard_vllm import LLMClient, ReshardTrainerInitInfo
        from transformers import LlamaForCausalLM
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    except Exception as exc:  # an optional part: say why it is skipped
        print(f"vLLM path skipped: {type(exc).__name__}: {exc}")
        return []
    from reshard_core.testing.world import free_port

    config = T.tiny_llama_config(
        vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["hidden"] * 3,
        num_hidden_layers=args["layers"], num_attention_heads=args["hidden"] // 64, num_key_value_heads=4,
        head_dim=64,
    )  # fmt: skip
    llm = T.offline_llm(
        T.write_model_dir(tempfile.mkdtemp(prefix="bench-delta-"), config), tp=1,
        weight_transfer_config={"backend": "reshard"},
    )  # fmt: skip
    rows = []
    try:
        for lr in args["lrs"]:
            model = LlamaForCausalLM(config).to(BF16)
            _init_like_hf(model, seed=0)
            trainer = MasterWeights(model, lr, seed=7)
            info = ReshardTrainerInitInfo("127.0.0.1", free_port(), 1, rank=0, timeout=300)
            engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=model)
            runs, held = {}, 0
            for delta in (True, False):
                engine.send_weights(delta=delta)  # full: the first delta update, or after the deltas
                runs[delta] = []
                for _ in range(args["steps"]):
                    trainer.step()
                    start = time.perf_counter()
                    verdict = engine.send_weights(delta=delta)
                    seconds = time.perf_counter() - start
                    d = engine.report.delta
                    changed = (d.changed_words, d.compared_words) if d else (0, 0)
                    held = d.held_bytes if d else held
                    runs[delta].append((seconds, verdict.received[1][0], *changed))
            engine.shutdown()
            on, off = runs[True], runs[False]
            changed = sum(r[2] for r in on)
            rows.append(dict(
                pair="vllm", lr=lr, changed=changed / max(sum(r[3] for r in on), 1),
                bytes_ratio=sum(r[1] for r in on) / sum(r[1] for r in off),
                bytes_per_changed=sum(r[1] for r in on) / max(changed, 1),
                time_ratio=statistics.median(r[0] for r in on) / statistics.median(r[0] for r in off),
                seconds_delta=statistics.median(r[0] for r in on),
                seconds_plain=statistics.median(r[0] for r in off),
                held_bytes=held,
                model_bytes=sum(p.nbytes for p in model.parameters()), exact=None,
            ))  # fmt: skip
    finally:
        T.shutdown_llm(llm)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    args = dict(steps=ns.steps, lrs=[float(x) for x in ns.lrs.split(",")], hidden=ns.hidden, layers=ns.layers,
                vocab=ns.vocab)  # fmt: skip
    rows = []
    for pair in ("megatron", "hf"):
        rows += run_world(bench_rank, 2, pair, args, timeout=3600)[0]
    if not ns.json:
        _print(rows, f"{ns.steps} steps per learning rate after a full first refit; 2 ranks, Gloo")
    if not ns.no_vllm:
        engine_rows = bench_vllm(args)
        rows += engine_rows
        if not ns.json and engine_rows:
            _print(engine_rows, "\nthe vLLM engine (offline LLM, TP1, CPU), timed per update end to end")
    if ns.json:
        print(json.dumps(rows, indent=2))


def _print(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'pair':9} {'lr':>6} {'changed':>8} {'bytes d/f':>10} {'B/changed':>10} {'time d/f':>9} "
          f"{'s delta':>8} {'s full':>8} {'snapshot/model':>15} {'exact':>6}")  # fmt: skip
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        print(f"{r['pair']:9} {r['lr']:6.0e} {r['changed']:8.2%} {r['bytes_ratio']:10.3f} "
              f"{r['bytes_per_changed']:10.2f} {r['time_ratio']:9.2f} {r['seconds_delta']:8.3f} "
              f"{r['seconds_plain']:8.3f} {r['held_bytes'] / max(r['model_bytes'], 1):15.2f} "
              f"{exact:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
