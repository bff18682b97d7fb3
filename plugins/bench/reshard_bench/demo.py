"""The demo's work on every rank: build a GPT in two layouts, refit, verify every element.

``demo_rank`` runs inside a world from ``worlds.spawn_world``; ``summarize`` folds the per-rank
results into the report ``reshard demo`` prints. The destination starts from other values (another
seed), so a weight the refit missed shows; the source is checked too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from reshard_core.testing.world import emit

from .gpt import GPT, PRESETS, GPTConfig
from .layouts import resolve_layout
from .pairs import build_pair
from .timing import timed

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
    config = _config(opts)
    for text in (opts.src, opts.dst):
        par = resolve_layout(text, opts.world)
        if opts.model == "megatron-gpt" and par.fsdp > 1:
            raise ValueError(f"layout {text!r}: megatron-gpt is built with tp, pp and dp only")
        if config.num_layers % par.pp:
            raise ValueError(f"layout {text!r}: {config.num_layers} layers do not divide into pp={par.pp}")
        with torch.device("meta"):
            GPT(config, tp=par.tp)  # raises ValueError when a size does not divide by tp


def _config(opts: DemoOptions) -> GPTConfig:
    return PRESETS["tiny" if opts.model == "megatron-gpt" else opts.model]


def demo_rank(rank: int, world: int, opts: DemoOptions) -> dict[str, Any]:
    """Build, refit twice (cold, then warm with the plan reused), verify; return this rank's facts.
    Emits each phase as it starts."""
    import reshard_core

    emit("phase", "building")
    kind = "megatron-gpt" if opts.model == "megatron-gpt" else "gpt"
    src, dst = resolve_layout(opts.src, world), resolve_layout(opts.dst, world)
    pair = build_pair(kind, _config(opts), src, dst, DTYPES[opts.dtype], seed=SEED)
    emit("phase", "refitting")
    kwargs = dict(transport=opts.transport, max_batch_bytes=opts.max_batch_bytes, timeout=opts.timeout)
    cold, cold_s = timed(lambda: reshard_core.refit(pair.src, pair.dst, **kwargs))
    warm, warm_s = timed(lambda: reshard_core.refit(pair.src, pair.dst, **kwargs))
    emit("phase", "verifying")
    problems = pair.check()
    return {
        "rank": rank, "styles": pair.styles, "elements": pair.dst_elements, "problems": problems,
        "cold": asdict(cold), "cold_seconds": cold_s, "warm": asdict(warm), "warm_seconds": warm_s,
    }  # fmt: skip


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


def default_layouts(world: int, model: str = "small") -> tuple[str, str]:
    """The demo's default training and inference layouts for ``world`` ranks (``dp`` fills the rest):
    FSDP2 over every rank (Megatron GPTModel: TP2×PP2 where it fits) into TP2."""
    dst = f"tp={2 if world % 2 == 0 else 1}"
    if model == "megatron-gpt":
        return ("tp=2,pp=2" if world % 4 == 0 else "tp=1"), dst
    return f"fsdp={world}", dst
