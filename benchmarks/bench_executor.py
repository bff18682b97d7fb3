"""Executor + Gloo transport vs the wire floor, on a GPT-shaped bf16 weight set in a 4-process world.

Run: ``python benchmarks/bench_executor.py [--pattern tp2dp2-tp4 ...] [--max-batch-bytes none,1MiB]
[--window 0] [--iters 11] [--json]``.

Each pattern builds a layout table by hand with Megatron's layouts (source TP×DP as a
``(replicas, tp)`` mesh, vocab-parallel embedding/output, column qkv/fc1 (fc1 gated, stride 2),
row proj/fc2, replicated norms and row biases; hidden 1024, 8 layers, vocab 32000: 0.40 GB),
plans every rank with ``plan_rank``, and times, interleaved in the same run (one floor, then one
refit per variant, per iteration):

- **wire floor**: the same per-pair byte volumes the plan sends, each pair as one message of
  preallocated contiguous bytes, receives posted first, over the same transport
  (``GlooCopyService``): no packing, no local copies, no landing;
- **refit** per variant (batch budget × executor window): ``execute_plan`` on a warm plan with a
  kept ``StagingPool`` and ``ExecMemo`` (what a prepared session does).

A time is the slowest rank's, from a common barrier. It prints medians over ``--iters``, the ratio
of medians (target ≤ 1.25) and the median of per-iteration ratios, the CPU seconds all ranks spent
(``getrusage``, every thread: on a 2-core machine both are CPU-bound, so the CPU ratio predicts
the time ratio), each rank's median phases (``ExecStats``), volumes and staging, and checks every
destination byte of every variant after the timed loop. ``--replica-choice prefer-idle`` is an
experiment for the planner (see ``prefer_idle_replicas``). ``--profile DIR`` writes each rank's
cProfile of the timed refits; ``$RESHARD_BENCH_MARK`` receives the ranks' pids when timing starts
(to attach ``perf record -p``). No assertions on time.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import resource
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from reshard_core.execute import ExecMemo, StagingPool, execute_plan
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.ops import OpKind, RankPlan
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import LayoutTable, TableBuilder
from reshard_core.specs import TensorMeta
from reshard_core.testing.world import run_world
from reshard_core.views import region

BF16 = torch.bfloat16
WORLD = 4


@dataclass(frozen=True)
class Shape:
    """GPT dimensions (Megatron names): ``ffn`` is the un-gated width, fc1 holds 2·ffn rows."""

    hidden: int = 1024
    layers: int = 8
    vocab: int = 32000
    ffn: int = 4096
    seq: int = 2048


@dataclass(frozen=True)
class Side:
    """One side's parallel layout over ranks ``offset..``: TP fastest, then PP stages, then DP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    offset: int = 0

    def stage_ranks(self, stage: int) -> list[list[int]]:
        """``[replica][tp]`` ranks of pipeline ``stage``."""
        return [
            [self.offset + t + self.tp * (stage + self.pp * d) for t in range(self.tp)]
            for d in range(self.dp)
        ]


PATTERNS = {
    "tp2dp2-tp4": (Side(tp=2, dp=2), Side(tp=4)),
    "tp1dp4-tp4": (Side(tp=1, dp=4), Side(tp=4)),
    "tp4-tp2pp2": (Side(tp=4), Side(tp=2, pp=2)),
    "tp2pp2-tp4": (Side(tp=2, pp=2), Side(tp=4)),
}


def gpt_weights(shape: Shape) -> list[tuple[str, tuple[int, ...], Shard | None, int]]:
    """``(name, global shape, TP placement or None, layer or -1 first stage / -2 last stage)``."""
    h, f = shape.hidden, shape.ffn
    out = [
        ("embedding.word_embeddings.weight", (shape.vocab, h), Shard(0), -1),
        ("embedding.position_embeddings.weight", (shape.seq, h), None, -1),
        ("decoder.final_layernorm.weight", (h,), None, -2),
        ("decoder.final_layernorm.bias", (h,), None, -2),
        ("output_layer.weight", (shape.vocab, h), Shard(0), -2),
    ]
    for n in range(shape.layers):
        p = f"decoder.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,), None, n),
            (p + "input_layernorm.bias", (h,), None, n),
            (p + "self_attention.linear_qkv.weight", (3 * h, h), Shard(0), n),
            (p + "self_attention.linear_qkv.bias", (3 * h,), Shard(0), n),
            (p + "self_attention.linear_proj.weight", (h, h), Shard(1), n),
            (p + "self_attention.linear_proj.bias", (h,), None, n),
            (p + "pre_mlp_layernorm.weight", (h,), None, n),
            (p + "pre_mlp_layernorm.bias", (h,), None, n),
            (p + "mlp.linear_fc1.weight", (2 * f, h), Shard(0, stride=2), n),
            (p + "mlp.linear_fc1.bias", (2 * f,), Shard(0, stride=2), n),
            (p + "mlp.linear_fc2.weight", (h, f), Shard(1), n),
            (p + "mlp.linear_fc2.bias", (h,), None, n),
        ]
    return out


def stage_of(where: int, side: Side, layers: int) -> int:
    """The pipeline stage holding a weight (layers split evenly; embedding first, output last)."""
    if where == -1:
        return 0
    if where == -2:
        return side.pp - 1
    return where * side.pp // layers


def side_layout(side: Side, stage: int, placement: Shard | None) -> Layout:
    """The Megatron extractor's layout: a ``(replicas, tp)`` mesh, size-1 dims dropped."""
    grid = side.stage_ranks(stage)
    dims = ([(side.dp, Replicate())] if side.dp > 1 else []) + (
        [(side.tp, placement or Replicate())] if side.tp > 1 else []
    )
    flat = tuple(r for row in grid for r in row)
    if not dims:
        return Layout(Mesh(flat, (1,)), (Replicate(),))
    return Layout(Mesh(flat, tuple(s for s, _ in dims)), tuple(p for _, p in dims))


def build_table(shape: Shape, src: Side, dst: Side) -> LayoutTable:
    builder = TableBuilder()
    for name, gshape, placement, where in gpt_weights(shape):
        meta = TensorMeta(name, gshape, BF16)
        for tag, side in (("src", src), ("dst", dst)):
            layout = side_layout(side, stage_of(where, side, shape.layers), placement)
            builder.add(tag, layout.mesh.ranks[0], meta, layout)
    return builder.build()


def global_tensor(meta: TensorMeta) -> torch.Tensor:
    """Deterministic bits for one logical tensor: every element's bf16 pattern is a function of its
    global index and the name (NaN and inf patterns included), cheap to build."""
    salt = zlib.crc32(meta.name.encode()) & 0xFFFF
    index = torch.arange(meta.numel, dtype=torch.int32)
    bits = (index * 40503 + salt).bitwise_and(0xFFFF).to(torch.int16)  # odd multiplier: a bijection
    return bits.view(meta.dtype).reshape(meta.shape)


def locals_of(table: LayoutTable, rank: int, side: str, fill: bool) -> dict[str, torch.Tensor]:
    """This rank's local tensors of one side (source filled from the global tensors)."""
    out = {}
    for entry in table.entries:
        for layout in entry.layouts(side):
            local_shape = layout.local_shape(tuple(entry.meta.shape), rank)
            if local_shape is None:
                continue
            local = torch.empty(local_shape, dtype=entry.meta.dtype)
            if fill:
                full = global_tensor(entry.meta)
                for box in layout.boxes(tuple(entry.meta.shape), rank):
                    region(local, box.local_offsets, box.sizes).copy_(region(full, box.offsets, box.sizes))
            else:
                local.zero_()
            out[entry.name] = local
    return out


def verify(table: LayoutTable, rank: int, dst: dict[str, torch.Tensor]) -> int:
    """Count destination tensors whose bytes differ from the global tensor's region."""
    bad = 0
    for entry in table.entries:
        if entry.name not in dst:
            continue
        full = global_tensor(entry.meta)
        for layout in entry.layouts("dst"):
            for box in layout.boxes(tuple(entry.meta.shape), rank):
                got = region(dst[entry.name], box.local_offsets, box.sizes).contiguous().view(torch.uint8)
                want = region(full, box.offsets, box.sizes).contiguous().view(torch.uint8)
                bad += not torch.equal(got, want)
    return bad


def pair_volumes(plan: RankPlan) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes this rank sends to / receives from each peer over the whole plan."""
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    for op in plan.ops:
        if op.kind is OpKind.LOCAL:
            continue
        per = sends if op.kind is OpKind.SEND else recvs
        per[op.peer] = per.get(op.peer, 0) + plan.bytes_of(op)
    return sends, recvs


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def cpu_seconds() -> float:
    """CPU seconds this process used so far, every thread (Gloo's I/O thread included)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def time_floor(transport, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> tuple:
    """One round of single large messages per pair (receives posted first, all at once): the slowest
    rank's seconds, this rank's CPU seconds."""
    dist.barrier()
    cpu, start = cpu_seconds(), time.perf_counter()
    for peer, buf in recvs.items():
        transport.submit_recv(buf, peer, 0)
    for peer, buf in sends.items():
        transport.submit_send(buf, peer, 0)
    transport.run()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return slowest(elapsed), cpu


def time_refit(variant: Variant, src, dst, transport, profiler) -> tuple[float, float, dict]:
    """One warm refit: the slowest rank's seconds, this rank's CPU seconds and ``ExecStats``."""
    dist.barrier()
    if profiler is not None:
        profiler.enable()
    cpu, start = cpu_seconds(), time.perf_counter()
    options = dict(pool=variant.pool, memo=variant.memo, **variant.options)
    stats = execute_plan(variant.plan, src, dst, transport, **options)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if profiler is not None:
        profiler.disable()
    return slowest(elapsed), cpu, asdict(stats)


@dataclass
class Variant:
    """One executor set-up timed in the run: a plan (batch budget), its pool, the window."""

    max_batch_bytes: int | None
    window: int
    plan: RankPlan
    pool: StagingPool
    seconds: list[float]
    cpu: list[float]
    stats: list[dict]
    memo: ExecMemo = field(default_factory=ExecMemo)
    """Kept across its refits, as a prepared session keeps one."""

    @property
    def options(self) -> dict:
        """``execute_plan`` keywords beyond the defaults."""
        return {"window": self.window} if self.window else {}

    @property
    def label(self) -> str:
        budget = "one batch" if self.max_batch_bytes is None else f"max_batch_bytes={self.max_batch_bytes}"
        return budget + (f", window={self.window}" if self.window else "")


def announce_timing(rank: int) -> None:
    """Write every rank's pid to ``$RESHARD_BENCH_MARK`` as timing starts (to attach a profiler)."""
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    path = os.environ.get("RESHARD_BENCH_MARK")
    if path and rank == 0:
        with open(path, "w") as f:
            f.write(",".join(map(str, pids)))


def floor_buffers(volumes: dict[int, int]) -> dict[int, torch.Tensor]:
    """One preallocated, already touched byte buffer per peer."""
    return {peer: torch.ones(n, dtype=torch.uint8) for peer, n in sorted(volumes.items())}


def replicas_of(entry, rank: int) -> list[int]:
    """The source ranks holding exactly what ``rank`` holds of ``entry`` (its replicate mesh dims)."""
    for layout in entry.src:
        coord = layout.mesh.coord_of(rank)
        if coord is None:
            continue
        dims = [d for d, p in enumerate(layout.placements) if isinstance(p, Replicate)]
        out = []
        for values in itertools.product(*(range(layout.mesh.shape[d]) for d in dims)):
            moved = list(coord)
            for d, v in zip(dims, values, strict=True):
                moved[d] = v
            out.append(layout.mesh.rank_at(tuple(moved)))
        return out
    return [rank]


def prefer_idle_replicas(table: LayoutTable, rank: int, budget: int | None) -> RankPlan:
    """Experiment for the planner (``--replica-choice prefer-idle``): the built-in plans, with every
    remote piece whose chosen sender itself receives part of that tensor moved to a replica that
    receives nothing of it. Builds every rank's plan (fine at this size, not at scale)."""
    plans = [plan_rank(table, r, max_batch_bytes=budget) for r in range(WORLD)]
    mine: list = []
    for entry in table.entries:
        ops = {r: [o for o in plans[r].ops if o.name == entry.name] for r in range(WORLD)}
        receivers = {r for r in range(WORLD) for o in ops[r] if o.kind is OpKind.RECV}
        own, sends = [], []
        for q in range(WORLD):
            for o in ops[q]:
                if o.kind is OpKind.SEND:
                    continue
                peer = o.peer
                if o.kind is OpKind.RECV and peer in receivers:
                    idle = [c for c in replicas_of(entry, peer) if c not in receivers and c != q]
                    peer = idle[0] if idle else peer
                if q == rank:
                    own.append(replace(o, peer=peer))
                if o.kind is OpKind.RECV and peer == rank:
                    sends.append(replace(o, kind=OpKind.SEND, peer=q))
        mine += own + sorted(sends, key=lambda o: o.peer)
    base = plans[rank]
    ops = tuple(sorted(mine, key=lambda o: o.batch))  # stable: tensor order kept inside a batch
    return RankPlan(rank, ops, base.tensors, base.num_batches, base.source_names)


def make_variants(table: LayoutTable, rank: int, opts: dict) -> list[Variant]:
    """Every (batch budget, window) pair asked for, planned for this rank."""
    out = []
    for budget in opts["max_batch_bytes"]:
        if opts["replica_choice"] == "prefer-idle":
            plan = prefer_idle_replicas(table, rank, budget)
        else:
            plan = plan_rank(table, rank, max_batch_bytes=budget)
        for window in opts["windows"]:
            out.append(Variant(budget, window, plan, StagingPool(), [], [], []))
    return out


def timed_loop(opts: dict, variants: list[Variant], src, dst, transport, floor: tuple) -> list[tuple]:
    """Warm up, then per iteration the wire floor and every variant's refit, interleaved."""
    profiler = cProfile.Profile() if opts["profile"] else None
    for _ in range(opts["warmup"]):
        time_floor(transport, *floor)
        for v in variants:
            time_refit(v, src, dst, transport, None)
    announce_timing(dist.get_rank())
    floors = []
    for _ in range(opts["iters"]):
        if opts["only"] != "refit":
            floors.append(time_floor(transport, *floor))
        if opts["only"] == "floor":
            continue
        for v in variants:
            seconds, cpu, stats = time_refit(v, src, dst, transport, profiler)
            v.seconds.append(seconds)
            v.cpu.append(cpu)
            v.stats.append(stats)
    if profiler is not None:
        os.makedirs(opts["profile"], exist_ok=True)
        profiler.dump_stats(os.path.join(opts["profile"], f"refit_rank{dist.get_rank()}.prof"))
    return floors


def verify_variant(table, rank, variant: Variant, src, dst, transport) -> int:
    """Wipe the destinations, refit once with ``variant`` and count wrong tensors."""
    for tensor in dst.values():
        tensor.view(torch.uint8).fill_(0xFF)
    execute_plan(variant.plan, src, dst, transport, pool=variant.pool, memo=variant.memo, **variant.options)
    return verify(table, rank, dst)


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    from reshard_gloo.transport import GlooCopyService

    torch.set_num_threads(opts["threads"])
    src_side, dst_side = PATTERNS[opts["pattern"]]
    table = build_table(Shape(**opts["shape"]), src_side, dst_side)
    variants = make_variants(table, rank, opts)
    src = locals_of(table, rank, "src", fill=True)
    dst = locals_of(table, rank, "dst", fill=False)
    send_vol, recv_vol = pair_volumes(variants[0].plan)
    transport = GlooCopyService(timeout=opts["timeout"])
    floor = (floor_buffers(send_vol), floor_buffers(recv_vol))
    floors = timed_loop(opts, variants, src, dst, transport, floor)
    bad = [verify_variant(table, rank, v, src, dst, transport) if opts["verify"] else None for v in variants]
    transport.close()
    return dict(
        rank=rank, floors=[f[0] for f in floors], cpu_floor=median_or_zero([f[1] for f in floors]),
        sends=send_vol, recvs=recv_vol,
        variants=[variant_result(v, b) for v, b in zip(variants, bad, strict=True)],
    )  # fmt: skip


def median_or_zero(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def variant_result(v: Variant, bad: int | None) -> dict:
    """What one rank reports for one variant: slowest-rank seconds, own CPU, median phases, counts."""
    phases = {k: median_or_zero([s[k] for s in v.stats]) for k in (v.stats[0] if v.stats else ())}
    counts = {k: val for k, val in (v.stats[-1].items() if v.stats else ()) if not k.startswith("seconds_")}
    return dict(
        label=v.label, max_batch_bytes=v.max_batch_bytes, window=v.window, seconds=v.seconds,
        cpu=median_or_zero(v.cpu), phases={k: x for k, x in phases.items() if k.startswith("seconds_")},
        counts=counts, batches=v.plan.num_batches, ops=len(v.plan.ops), bad=bad, pool_bytes=v.pool.held_bytes,
    )  # fmt: skip


def summarize(results: list[dict], opts: dict) -> dict:
    """Medians and ratios per variant (times are the slowest rank's, identical on every rank)."""
    floors = results[0]["floors"]
    floor = median_or_zero(floors)
    wire = sum(sum(r["sends"].values()) for r in results)
    shape = Shape(**opts["shape"])
    model_bytes = sum(TensorMeta(n, s, BF16).numel * 2 for n, s, _, _ in gpt_weights(shape))
    variants = []
    for k, first in enumerate(results[0]["variants"]):
        seconds = first["seconds"]
        refit = median_or_zero(seconds)
        usable = wire > 0 and floors and seconds
        paired = statistics.median(r / f for r, f in zip(seconds, floors, strict=True)) if usable else None
        variants.append(dict(
            label=first["label"], max_batch_bytes=first["max_batch_bytes"], window=first["window"],
            refit_s=refit, refit_all=seconds, ratio=refit / floor if usable else None,
            paired_ratio=paired,
            cpu_s=sum(r["variants"][k]["cpu"] for r in results),
            local_bytes=sum(r["variants"][k]["counts"].get("bytes_local", 0) for r in results),
            ranks=[dict(rank=r["rank"], sends=r["sends"], **r["variants"][k]) for r in results],
        ))  # fmt: skip
    return dict(
        pattern=opts["pattern"], model_gb=model_bytes / 1e9, threads=opts["threads"], wire_bytes=wire,
        replica_choice=opts["replica_choice"],
        floor_s=floor, floor_all=floors, cpu_floor_s=sum(r["cpu_floor"] for r in results), variants=variants,
    )  # fmt: skip


def print_report(s: dict) -> None:
    mb = 1e6
    print(f"pattern {s['pattern']}: {s['model_gb']:.3f} GB bf16, {s['wire_bytes'] / mb:.1f} MB on the wire "
          f"(all pairs), threads/rank={s['threads']}, replica choice {s['replica_choice']}")  # fmt: skip
    if s["wire_bytes"]:
        print(f"  wire floor  median {s['floor_s']:.3f} s, CPU {s['cpu_floor_s']:.3f} s (all ranks) | "
              + " ".join(f"{x:.3f}" for x in s["floor_all"]))  # fmt: skip
    for v in s["variants"]:
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
        paired = "n/a" if v["paired_ratio"] is None else f"{v['paired_ratio']:.2f}"
        print(f"  refit [{v['label']}]  median {v['refit_s']:.3f} s, CPU {v['cpu_s']:.3f} s, "
              f"ratio {ratio} (paired {paired}), local {v['local_bytes'] / mb:.1f} MB | "
              + " ".join(f"{x:.3f}" for x in v["refit_all"]))  # fmt: skip
        for r in v["ranks"]:
            print("    " + rank_line(r))


def rank_line(r: dict) -> str:
    """One rank's median phases, volumes and counts for one variant."""
    mb, ph, c = 1e6, r["phases"], r["counts"]
    sends = ", ".join(f"→{p} {n / mb:.1f}" for p, n in sorted(r["sends"].items())) or "-"
    verdict = {None: "not checked", 0: "ok"}.get(r["bad"], f"{r['bad']} WRONG")
    return (
        f"rank {r['rank']}: cpu {r['cpu']:.3f} total {ph.get('seconds_total', 0):.3f} "
        f"pack {ph.get('seconds_pack', 0):.3f} transfer {ph.get('seconds_transfer', 0):.3f} "
        f"local {ph.get('seconds_local', 0):.3f} unpack {ph.get('seconds_unpack', 0):.3f} | "
        f"sends MB {sends} | msgs {c.get('messages_sent', 0)} batches {r['batches']} | staging "
        f"{c.get('peak_staging_bytes', 0) / mb:.1f} MB | {verdict}"
    )


def parse_budget(text: str) -> int | None:
    """``none`` (one batch) or a byte count, with an optional KiB/MiB/GiB or KB/MB/GB suffix."""
    text = text.strip()
    if text.lower() == "none":
        return None
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    for suffix, factor in units.items():
        if text.lower().endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", action="append", choices=sorted(PATTERNS), help="default: tp2dp2-tp4")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batch-bytes", default="none,1MiB",
                    help="comma list of batch budgets to compare (none = one batch), e.g. none,1MiB,4MiB")
    ap.add_argument("--window", default="0", help="comma list of executor windows (staged bytes in flight)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--profile", default=None, help="directory for each rank's cProfile of the timed refits")
    ap.add_argument("--only", choices=("refit", "floor"), help="time one side only (for profilers)")
    ap.add_argument("--replica-choice", choices=("builtin", "prefer-idle"), default="builtin",
                    help="prefer-idle: experiment, see prefer_idle_replicas")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shape = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, ffn=args.ffn)
    summaries = []
    for pattern in args.pattern or ["tp2dp2-tp4"]:
        opts = dict(
            pattern=pattern, shape=shape, iters=args.iters, warmup=args.warmup, threads=args.threads,
            max_batch_bytes=[parse_budget(b) for b in args.max_batch_bytes.split(",")],
            windows=[int(w) for w in args.window.split(",")], timeout=args.timeout, verify=args.verify,
            profile=args.profile, only=args.only, replica_choice=args.replica_choice,
        )  # fmt: skip
        results = run_world(_rank_main, WORLD, opts, timeout=1800, pg_timeout=600)
        summary = summarize(results, opts)
        summaries.append(summary)
        if not args.json:
            print_report(summary)
    if args.json:
        json.dump(summaries, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
