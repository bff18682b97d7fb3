"""A format-mapped warm refit vs a same-format refit of the very same logical tensors and bytes.

Run: ``python benchmarks/bench_formats.py [--case hf-fsdp-to-vllm-tp4 ...] [--reps 9] [--json]``.

Each case builds, in a 4-process Gloo world on loopback, a source and a destination in different
formats and prepares the format-mapped refit (``reshard_core.prepare(src, dst)``, formats
detected). The **control** is a same-format refit of the same logical tensors: every rank copies
each logical piece it holds (source and destination) into a plain contiguous tensor declared with
the logical layout (``declare_layout``), so the control plans the same logical table — the same
ops, bytes and messages — but reads and writes plain tensors instead of views of fused, padded,
group-interleaved parameters. The ratio of the two medians is the cost of the format layer
(target ≤ 1.1×). Refits alternate (mapped, control) in every repetition, so a loaded machine
slows both alike; a time is the slowest rank's from a common barrier. After the timed loop the
mapped destination is checked element by element against the control's. No assertions on time.

Cases:

- ``hf-fsdp-to-vllm-tp4``: transformers ``LlamaForCausalLM`` under FSDP2 (uneven shards) → the
  vLLM convention at TP4 (fused ``qkv_proj`` with kv heads replicated, fused ``gate_up_proj``,
  64-padded vocab);
- ``megatron-tp2-to-vllm-tp4``: Megatron-Core ``GPTModel`` TP2 (group-major ``linear_qkv``, gated
  ``linear_fc1`` with stride 2, padded vocab) → the vLLM convention at TP4 (needs megatron-core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

WORLD = 4
HEADS, KV_HEADS = 16, 2


def _llama_config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
    )  # fmt: skip


def _vllm_engine(config, dtype: torch.dtype):
    from reshard_core.formats.vllm import VLLMParallel
    from reshard_core.testing.vllm_standin import VLLMStandInForCausalLM

    return VLLMStandInForCausalLM(config, VLLMParallel.of(range(WORLD)), dtype=dtype, fill=0.0)


def _hf_fsdp(config, dtype: torch.dtype):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _megatron_tp2(config, dtype: torch.dtype):
    from reshard_core.formats.megatron import MegatronFormat
    from reshard_core.testing.models import build_gpt, build_pg_collection, init_megatron

    init_megatron()
    pgs = build_pg_collection(tp=2)
    model = build_gpt(
        pgs, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=HEADS, num_query_groups=KV_HEADS, ffn_hidden_size=config.intermediate_size,
        vocab_size=-(-config.vocab_size // 256) * 256, max_sequence_length=64, bias=False,
        normalization="RMSNorm", rope=True, dtype=dtype,
    )  # fmt: skip
    for param in model.parameters():  # Megatron keeps RMSNorm weights in fp32; the engine is all bf16
        param.data = param.data.to(dtype)
    return model, MegatronFormat(vocab_size=config.vocab_size)


def _build(case: str, hidden: int, layers: int, vocab: int, dtype: torch.dtype):
    """``(src, dst, prepare kwargs)`` of this rank for ``case``."""
    config = _llama_config(hidden, layers, vocab)
    if case == "hf-fsdp-to-vllm-tp4":
        return _hf_fsdp(config, dtype), _vllm_engine(config, dtype), {}
    if case == "megatron-tp2-to-vllm-tp4":
        src, fmt = _megatron_tp2(config, dtype)
        return src, _vllm_engine(config, dtype), {"src_format": fmt}
    raise SystemExit(f"unknown case {case!r}")


def _control(model, side: str, fmt) -> nn.Module:
    """Plain contiguous copies of every logical piece ``model`` holds, declared with its layout."""
    from reshard_core.coordination.problems import Problems
    from reshard_core.extract import ExtractContext, declare_layout
    from reshard_core.preparation.sides import logical_side
    from reshard_core.views import materialize, region

    specs, _ = logical_side(model, side, fmt, ExtractContext.create(), (), Problems())
    mirror = nn.Module()
    for i, spec in enumerate(specs):
        local = spec.tensor
        piece = materialize(region(local, (0,) * local.dim(), tuple(local.shape))).detach().clone()
        param = nn.Parameter(piece.contiguous(), requires_grad=False)
        declare_layout(param, layout=spec.layout, shape=spec.meta.shape, name=spec.meta.name)
        mirror.register_parameter(f"p{i}", param)
    return mirror


def _worker(rank: int, world: int, case: str, reps: int, hidden: int, layers: int, vocab: int) -> dict:
    from reshard_bench.timing import median, timed

    import reshard_core
    from reshard_core.formats import resolve_format

    dtype = torch.bfloat16
    src, dst, kwargs = _build(case, hidden, layers, vocab, dtype)
    mapped = reshard_core.prepare(src, dst, **kwargs)
    ctl_src = _control(src, "src", resolve_format(src, kwargs.get("src_format")))
    ctl_dst = _control(dst, "dst", resolve_format(dst, None))
    control = reshard_core.prepare(ctl_src, ctl_dst)
    first = mapped.refit()
    control.refit()
    times = {"mapped": [], "control": []}
    for _ in range(reps):
        times["mapped"].append(timed(mapped.refit)[1])
        times["control"].append(timed(control.refit)[1])
    report = mapped.refit()
    ctl_report = control.refit()
    mirror = _control(dst, "dst", resolve_format(dst, None))  # the mapped destination, as plain pieces
    differ = [
        n for (n, a), (_, b) in zip(mirror.named_parameters(), ctl_dst.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]  # fmt: skip
    volumes = torch.tensor(
        [report.bytes_sent, ctl_report.bytes_sent, report.bytes_local, ctl_report.bytes_local, len(differ)]
    )
    dist.all_reduce(volumes)
    return {
        "mapped_s": median(times["mapped"]),
        "control_s": median(times["control"]),
        "sent": volumes[:2].tolist(),
        "local": volumes[2:4].tolist(),
        "differ": int(volumes[4]),
        "elements": sum(p.numel() for p in mirror.parameters()),
        "first_refit_s": first.seconds.get("total", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", action="append", choices=["hf-fsdp-to-vllm-tp4", "megatron-tp2-to-vllm-tp4"]
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32001)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from reshard_core.testing.world import run_world

    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the workers' import-time library warnings

    rows = {}
    for case in args.case or ["hf-fsdp-to-vllm-tp4", "megatron-tp2-to-vllm-tp4"]:
        results = run_world(
            _worker, WORLD, case, args.reps, args.hidden, args.layers, args.vocab, timeout=900
        )
        r = results[0]
        rows[case] = {**r, "ratio": r["mapped_s"] / r["control_s"] if r["control_s"] else None}
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(
        f"reshard bench_formats: {WORLD} processes, gloo, bf16, hidden {args.hidden}, "
        f"{args.layers} layers, median of {args.reps} warm refits"
    )
    print(
        f"{'case':28} {'mapped s':>9} {'control s':>9} {'ratio':>6} "
        f"{'sent MB':>8} {'local MB':>8} {'verified':>9}"
    )
    for case, r in rows.items():
        same = r["sent"][0] == r["sent"][1] and r["local"][0] == r["local"][1]
        print(
            f"{case:28} {r['mapped_s']:9.4f} {r['control_s']:9.4f} {r['ratio']:5.2f}x "
            f"{r['sent'][0] / 1e6:8.1f} {r['local'][0] / 1e6:8.1f} "
            f"{'yes' if not r['differ'] and same else 'NO':>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
