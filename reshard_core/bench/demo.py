"""The demo's work on every rank: build a GPT in two layouts, refit, verify every element.

``demo_rank`` runs inside a world from ``spawn.spawn_world``; ``summarize`` folds the per-rank
results into the report ``reshard demo`` prints. The destination starts from other values (another
seed), so a weight the refit missed shows; the source is checked too.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .gpt import GPT, PRESETS
from .layouts import build_model, check_model, resolve_layout
from .spawn import Events

SEED = 1234
MODELS = (*PRESETS, "megatron-gpt")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class DemoOptions:
    """What ``reshard demo`` was asked for (layout strings as given; ``dp`` fills the world)."""

    model: str = "small"
    src: str = "fsdp=4"
    dst: str = "tp=2"
    world: int = 4
    transport: str = "gloo"
    max_batch_bytes: int | None = None
    dtype: str = "bf16"
    timeout: float = 60.0


def check_options(opts: DemoOptions) -> None:
    """Raise ``ValueError`` (a usage error) when the model cannot be built in these layouts."""
    if opts.model not in MODELS:
        raise ValueError(f"unknown model {opts.model!r}; choose from {', '.join(MODELS)}")
    if opts.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {opts.dtype!r}; choose from {', '.join(DTYPES)}")
    if opts.world < 2:
        raise ValueError(f"--world-size must be at least 2, got {opts.world}")
    for text in (opts.src, opts.dst):
        par = resolve_layout(text, opts.world)
        if opts.model == "megatron-gpt":
            if par.fsdp > 1:
                raise ValueError(f"layout {text!r}: megatron-gpt is built with tp, pp and dp only")
            continue
        config = PRESETS[opts.model]
        if config.num_layers % par.pp:
            raise ValueError(f"layout {text!r}: {config.num_layers} layers do not divide into pp={par.pp}")
        with torch.device("meta"):
            GPT(config, tp=par.tp)  # raises ValueError when a size does not divide by tp


def demo_rank(rank: int, world: int, events: Events, opts: DemoOptions) -> dict[str, Any]:
    """Build, refit twice (cold, then warm with the plan reused), verify; return this rank's facts."""
    import reshard_core

    events.emit("phase", "building")
    src, dst, check, styles, elements = _build(opts, world)
    events.emit("phase", "refitting")
    kwargs = dict(transport=opts.transport, max_batch_bytes=opts.max_batch_bytes, timeout=opts.timeout)
    cold, cold_s = _timed(lambda: reshard_core.refit(src, dst, **kwargs))
    warm, warm_s = _timed(lambda: reshard_core.refit(src, dst, **kwargs))
    events.emit("phase", "verifying")
    problems = check()
    return {
        "rank": rank, "styles": styles, "elements": elements, "problems": problems,
        "cold": asdict(cold), "cold_seconds": cold_s, "warm": asdict(warm), "warm_seconds": warm_s,
    }  # fmt: skip


def _timed(fn) -> tuple[Any, float]:
    """``fn()`` and the slowest rank's seconds for it (ranks start together)."""
    dist.barrier()
    start = time.perf_counter()
    value = fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return value, float(elapsed.item())


def _build(opts: DemoOptions, world: int):
    """(src model, dst model, check() -> problems, (src style, dst style), dst elements here)."""
    dtype = DTYPES[opts.dtype]
    src_par, dst_par = resolve_layout(opts.src, world), resolve_layout(opts.dst, world)
    if opts.model == "megatron-gpt":
        return _build_megatron(src_par, dst_par, dtype)
    config = PRESETS[opts.model]
    src = build_model(config, src_par, "src", seed=SEED, dtype=dtype)
    dst = build_model(config, dst_par, "dst", seed=SEED + 1, dtype=dtype)

    def check() -> list[str]:
        return check_model(dst, SEED) + [f"source {p}" for p in check_model(src, SEED)]

    local = [h.tensor.to_local() if h.layout is None else h.tensor for h in dst.holdings]
    elements = sum(t.numel() for t in local)
    return src.model, dst.model, check, (src.style, dst.style), elements


def _build_megatron(src_par, dst_par, dtype):
    """Megatron-Core GPTModels (needs megatron-core); checked against a TP1 reference built here."""
    from ..extract import extract_specs
    from ..testing.models import build_gpt, build_pg_collection, init_megatron

    init_megatron()
    kwargs = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=128, vocab_size=256, dtype=dtype)  # fmt: skip
    src = build_gpt(build_pg_collection(src_par.tp, src_par.pp), seed=SEED, **kwargs)
    dst = build_gpt(build_pg_collection(dst_par.tp, dst_par.pp), seed=SEED + 1, **kwargs)
    ref = build_gpt(build_pg_collection(1, 1), seed=SEED, **kwargs)
    full = {s.meta.name: s.tensor for s in extract_specs(ref, "src")}
    rank = dist.get_rank()

    def check() -> list[str]:
        problems = []
        for spec in extract_specs(dst, "dst"):
            for box in spec.layout.boxes(spec.meta.shape, rank):
                got = _region(spec.tensor, box.local_offsets, box.sizes)
                if not torch.equal(got, _region(full[spec.meta.name], box.offsets, box.sizes)):
                    problems.append(f"{spec.meta.name}: the box at {box.offsets} differs on rank {rank}")
        return problems

    elements = sum(p.numel() for p in dst.parameters())
    return src, dst, check, ("megatron-core", "megatron-core"), elements


def _region(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]


def summarize(opts: DemoOptions, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo's report: layouts, bytes, seconds, GB/s, and whether every element was verified."""
    warm = [r["warm"] for r in results]
    cold = [r["cold"] for r in results]
    remote = sum(w["bytes_sent"] for w in warm)
    local = sum(w["bytes_local"] for w in warm)
    seconds = results[0]["warm_seconds"]
    problems = [p for r in results for p in r["problems"]]
    prepare = max(sum(c["seconds"].get(k, 0.0) for k in ("extract", "exchange", "plan")) for c in cold)
    return {
        "model": opts.model,
        "dtype": opts.dtype,
        "world_size": opts.world,
        "transport": opts.transport,
        "src": {"layout": str(resolve_layout(opts.src, opts.world)), "style": results[0]["styles"][0]},
        "dst": {"layout": str(resolve_layout(opts.dst, opts.world)), "style": results[0]["styles"][1]},
        "bytes_moved": remote + local,
        "bytes_remote": remote,
        "bytes_local": local,
        "messages": sum(w["messages"] for w in warm),
        "batches": max(w["batches"] for w in warm),
        "first_refit_seconds": results[0]["cold_seconds"],
        "prepare_seconds": prepare,
        "refit_seconds": seconds,
        "gb_per_s": (remote + local) / seconds / 1e9 if seconds > 0 else 0.0,
        "plan_reused": all(w["reused_plan"] for w in warm),
        "elements_checked": sum(r["elements"] for r in results),
        "verified": not problems,
        "problems": problems,
    }


def default_layouts(world: int) -> tuple[str, str]:
    """The demo's default training and inference layouts for ``world`` ranks."""
    return f"fsdp={world}", f"tp={2 if world % 2 == 0 else 1}"

