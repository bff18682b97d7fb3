"""``reshard bench``: warm refit time against the wire floor and against Megatron-Core, per layout pair.

For every layout pair, in one local Gloo world: build the model pair; time ``warmup + reps`` warm
refits of the prepared session (``Session.refit()``; the median; each is the slowest rank's time,
ranks starting together; ``reshard_core.refit()``, which first agrees on the cached session with one
small all-gather, is timed too, as ``api_refit_seconds`` in the JSON); check every
destination element; time the wire floor (``floor.py``) for the plan's per-pair volumes the same
way (and once more with the plan's local-copy volume copied while it is on the wire, and once
with the copies the layouts force instead: the layout floor) and the
memcpy floor (each rank's received and local volumes copied once), and, for a transport other than
gloo, a gloo session of the same models: one of each after every refit so all share the machine's
drift; then, for
Megatron GPTModels with megatron-core installed, zero the destination and time
``swap_model_weights(..., "gloo")`` the same way and check its result too. Ranks report through
``emit`` as they go, so a Megatron case that outlives ``megatron_deadline`` seconds ends the world
(reported as not finished) and a fresh world takes the remaining pairs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from reshard_core.testing.world import WorldStopped, emit

from .floor import LayoutCopies, MemcpyFloor, WireFloor, local_volume, pair_volumes
from .gpt import PRESETS
from .layouts import resolve_layout
from .pairs import build_pair, megatron_available
from .timing import median, timed
from .worlds import spawn_world

SEED = 4321
DEFAULT_PAIRS = ("tp=2->tp=4", "tp=1->tp=4", "tp=4->tp=2,pp=2", "tp=2,pp=2->tp=1")
MODELS = ("auto", "gpt", "megatron-gpt")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class BenchOptions:
    """What to measure. ``model``: ``gpt`` (pure torch, Megatron-style attributes), ``megatron-gpt``
    (Megatron-Core GPTModel, compared with Megatron-Core's refit), ``auto`` (megatron-gpt when
    megatron-core is installed). ``size``: a ``gpt.PRESETS`` name. Pairs: ``"src->dst"`` layouts
    (``dp`` fills the world)."""

    model: str = "auto"
    size: str = "bench"
    pairs: tuple[str, ...] = DEFAULT_PAIRS
    world: int = 4
    reps: int = 5
    warmup: int = 1
    transport: str = "gloo"
    max_batch_bytes: int | None = None
    megatron: bool = True
    megatron_deadline: float = 120.0
    dtype: str = "bf16"
    timeout: float = 120.0

    @property
    def resolved_model(self) -> str:
        if self.model == "auto":
            return "megatron-gpt" if megatron_available() else "gpt"
        return self.model

    @property
    def compare_megatron(self) -> bool:
        return self.megatron and self.resolved_model == "megatron-gpt"


def parse_pair(text: str) -> tuple[str, str]:
    """``"tp=2->tp=4"`` (or ``"tp=2:tp=4"``) -> ``("tp=2", "tp=4")``; ``ValueError`` otherwise."""
    for sep in ("->", ":"):
        if sep in text:
            src, _, dst = text.partition(sep)
            if src.strip() and dst.strip():
                return src.strip(), dst.strip()
    raise ValueError(f"bad layout pair {text!r}: expected SRC->DST, e.g. tp=2->tp=4")


def check_options(opts: BenchOptions) -> None:
    """Raise ``ValueError`` (a usage error) for options that cannot run."""
    if opts.model not in MODELS:
        raise ValueError(f"unknown model {opts.model!r}; choose from {', '.join(MODELS)}")
    if opts.model == "megatron-gpt" and not megatron_available():
        raise ValueError("--model megatron-gpt needs megatron-core: pip install megatron-core==0.16.1 einops")
    if opts.size not in PRESETS:
        raise ValueError(f"unknown size {opts.size!r}; choose from {', '.join(PRESETS)}")
    if opts.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {opts.dtype!r}; choose from {', '.join(DTYPES)}")
    if opts.reps < 1 or opts.warmup < 0 or opts.world < 2:
        raise ValueError("need --reps >= 1, --warmup >= 0 and --world-size >= 2")
    for pair in opts.pairs:
        for text in parse_pair(pair):
            par = resolve_layout(text, opts.world)
            if par.fsdp > 1:
                raise ValueError(f"layout {text!r}: the benchmark builds tp, pp and dp layouts")


# ---------------------------------------------------------------- on every rank


def bench_rank(rank: int, world: int, opts: BenchOptions, pairs: list[str]) -> None:
    """Measure ``pairs`` in order; rank 0 reports each result (``emit``) as it is known."""
    for pair in pairs:
        src_text, dst_text = parse_pair(pair)
        emit("phase", (pair, "building"))
        models = build_pair(opts.resolved_model, PRESETS[opts.size], resolve_layout(src_text, world),
                            resolve_layout(dst_text, world), DTYPES[opts.dtype], seed=SEED)  # fmt: skip
        emit("phase", (pair, "refits and wire floor"))
        result = _ours(models, opts)
        if rank == 0:
            emit("ours", (pair, result))
        if opts.compare_megatron:
            emit("megatron-start", pair)
            megatron = _megatron(models, opts)
            if rank == 0:
                emit("megatron", (pair, megatron))
        del models
        gc.collect()


def _ours(models, opts: BenchOptions) -> dict[str, Any]:
    """Warm refits interleaved with the wire floor and the floor with local copies (one of each per
    repetition), so that a machine whose speed drifts during the run skews all three alike."""
    import reshard_core

    kwargs = dict(transport=opts.transport, max_batch_bytes=opts.max_batch_bytes, timeout=opts.timeout)
    first, first_s = timed(lambda: reshard_core.refit(models.src, models.dst, **kwargs))
    session = reshard_core.prepare(models.src, models.dst, **kwargs)
    plan = session.plan
    sends, recvs = pair_volumes(plan)
    floor = WireFloor(session.transport, dist.get_rank(), sends, recvs, local=local_volume(plan))
    memcpy = MemcpyFloor(sum(recvs.values()), local_volume(plan))
    copies = LayoutCopies(plan, session.src_tensors, session.dst_tensors)
    gloo = None  # another transport is also timed against gloo, on the same models in the same world
    if opts.transport != "gloo":
        gloo = reshard_core.prepare(models.src, models.dst, **{**kwargs, "transport": "gloo"})
    for _ in range(opts.warmup):
        session.refit()
        floor.run()
        floor.run(floor.copy_local)
        floor.run(copies.run)
        memcpy.run()
        if gloo is not None:
            gloo.refit()
    runs, floor_runs, with_local, api_runs, memcpy_runs, gloo_runs = [], [], [], [], [], []
    layout_runs = []
    for _ in range(opts.reps):
        runs.append(timed(session.refit))
        floor_runs.append(timed(floor.run)[1])
        with_local.append(timed(lambda: floor.run(floor.copy_local))[1])
        layout_runs.append(timed(lambda: floor.run(copies.run))[1])
        memcpy_runs.append(timed(memcpy.run)[1])
        if gloo is not None:
            gloo_runs.append(timed(gloo.refit)[1])
        api_runs.append(timed(lambda: reshard_core.refit(models.src, models.dst, **kwargs))[1])
    last = runs[-1][0]
    totals = torch.tensor([last.bytes_sent, last.bytes_local, last.messages, floor.nbytes, copies.nbytes],
                          dtype=torch.int64)  # fmt: skip
    dist.all_reduce(totals)
    batches = torch.tensor([last.batches], dtype=torch.int64)
    dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    phases = _slowest_phases(last.seconds)
    return {
        "refit_seconds": median([s for _, s in runs]),
        "refit_runs": [s for _, s in runs],
        "first_refit_seconds": first_s,
        "plan_reused": all(r.reused_plan for r, _ in runs),
        "bytes_remote": int(totals[0]),
        "bytes_local": int(totals[1]),
        "messages": int(totals[2]),
        "batches": int(batches[0]),
        "phases": phases,
        "floor_seconds": median(floor_runs),
        "floor_runs": floor_runs,
        "floor_bytes": int(totals[3]),
        "floor_with_local_seconds": median(with_local),
        "layout_floor_seconds": median(layout_runs),
        "layout_floor_runs": layout_runs,
        "layout_copy_bytes": int(totals[4]),
        "memcpy_floor_seconds": median(memcpy_runs),
        "memcpy_floor_runs": memcpy_runs,
        **({"gloo_seconds": median(gloo_runs), "gloo_runs": gloo_runs} if gloo is not None else {}),
        "api_refit_seconds": median(api_runs),
        **_checked(models),
    }


def _slowest_phases(seconds: dict[str, float]) -> dict[str, float]:
    """Per executor phase, the slowest rank's seconds (of the last warm refit)."""
    keys = ("pack", "transfer", "local", "unpack", "total")
    values = torch.tensor([seconds.get(k, 0.0) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(keys, values.tolist(), strict=True))


def _checked(models) -> dict[str, Any]:
    """Check every destination element; ``verified`` and a first problem (from the lowest rank)."""
    problems = models.check()
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    counts[dist.get_rank()] = len(problems)
    dist.all_reduce(counts)
    first = problems[0] if problems else None
    return {"verified": int(counts.sum()) == 0, "problems": int(counts.sum()), "first_problem": first}


def _megatron(models, opts: BenchOptions) -> dict[str, Any]:
    from .megatron_peer import megatron_refit

    with torch.no_grad():
        for t in models.dst.parameters():
            t.zero_()
    first_s = timed(lambda: megatron_refit(models.src, models.dst))[1]  # builds and caches its plan
    for _ in range(opts.warmup):
        megatron_refit(models.src, models.dst)
    runs = [timed(lambda: megatron_refit(models.src, models.dst))[1] for _ in range(opts.reps)]
    return {"finished": True, "seconds": median(runs), "runs": runs, "first_seconds": first_s,
            **_checked(models)}  # fmt: skip


# ---------------------------------------------------------------- in the parent


@dataclass
class BenchRun:
    """Results as they arrive: one row per pair (``ours`` and ``megatron`` parts)."""

    opts: BenchOptions
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    phase: tuple[str, str] | None = None
    megatron_started: tuple[str, float] | None = None

    def on_event(self, rank: int, kind: str, data: Any) -> None:
        if kind == "phase":
            self.phase = data
        elif kind == "ours":
            self.rows.setdefault(data[0], {})["ours"] = data[1]
        elif kind == "megatron-start":
            self.megatron_started = (data, time.monotonic())
            self.phase = (data, "megatron-core")
        elif kind == "megatron":
            self.rows.setdefault(data[0], {})["megatron"] = data[1]
            self.megatron_started = None

    def watchdog(self) -> str | None:
        """The pair whose Megatron-Core refit outlived the deadline, if any."""
        if self.megatron_started is None:
            return None
        pair, since = self.megatron_started
        return pair if time.monotonic() - since > self.opts.megatron_deadline else None


def run_bench(
    opts: BenchOptions,
    *,
    on_phase: Callable[[tuple[str, str]], None] | None = None,
    spawn: Callable[..., Any] = spawn_world,
) -> dict[str, Any]:
    """Run every pair (fresh worlds after a Megatron case misses its deadline); return the report."""
    run = BenchRun(opts)
    pending = list(opts.pairs)

    def on_event(rank: int, kind: str, data: Any) -> None:
        run.on_event(rank, kind, data)
        if on_phase is not None and run.phase is not None:
            on_phase(run.phase)

    while pending:
        try:
            spawn(bench_rank, opts.world, opts, pending, on_event=on_event, watchdog=run.watchdog,
                  timeout=3600.0, pg_timeout=max(300.0, opts.megatron_deadline + 60.0))  # fmt: skip
            pending = []
        except WorldStopped as stop:
            pair = str(stop)
            unfinished = {"finished": False, "deadline": opts.megatron_deadline}
            run.rows.setdefault(pair, {})["megatron"] = unfinished
            run.megatron_started = None
            pending = pending[pending.index(pair) + 1 :]
    return report(opts, run.rows)


def report(opts: BenchOptions, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's JSON-able report: options, and per pair our refit, the floor, the ratio, and
    Megatron-Core's time with the speed-up (or that it did not finish) and the speed-up bound: Megatron's
    time over the floor with local copies, the most any refit of the same volumes could show."""
    config = PRESETS[opts.size]
    out_rows = []
    for pair in opts.pairs:
        row = rows.get(pair, {})
        ours, megatron = row.get("ours"), row.get("megatron")
        entry: dict[str, Any] = {"pair": pair, "ours": ours, "megatron": megatron}
        if ours is not None and ours["floor_bytes"] > 0:  # nothing on the wire: no floor to compare with
            entry["floor_ratio"] = ours["refit_seconds"] / ours["floor_seconds"]
        if ours is not None and ours.get("floor_with_local_seconds", 0) > 0:
            entry["floor_with_local_ratio"] = ours["refit_seconds"] / ours["floor_with_local_seconds"]
        if ours is not None and ours.get("layout_floor_seconds", 0) > 0:
            entry["layout_floor_ratio"] = ours["refit_seconds"] / ours["layout_floor_seconds"]
        if ours is not None and ours.get("memcpy_floor_seconds", 0) > 0:
            entry["memcpy_ratio"] = ours["refit_seconds"] / ours["memcpy_floor_seconds"]
        if ours is not None and ours.get("gloo_seconds", 0) > 0:
            entry["gloo_speedup"] = ours["gloo_seconds"] / ours["refit_seconds"]
        if ours is not None and megatron is not None and megatron.get("finished"):
            entry["speedup"] = megatron["seconds"] / ours["refit_seconds"]
            bound = ours.get("floor_with_local_seconds", 0)
            if bound > 0:  # no refit that moves these bytes and copies these local bytes is faster
                entry["speedup_bound"] = megatron["seconds"] / bound
                entry["of_bound"] = entry["speedup"] / entry["speedup_bound"]
        out_rows.append(entry)
    from .notes import megatron_skip_reason, spread_warnings

    return {
        "options": asdict(opts) | {"model": opts.resolved_model},
        "model_bytes": config.nbytes(DTYPES[opts.dtype]),
        "megatron_core": opts.compare_megatron,
        "megatron_skipped": megatron_skip_reason(opts.megatron, opts.model, opts.resolved_model),
        "warnings": spread_warnings(out_rows),
        "rows": out_rows,
    }
