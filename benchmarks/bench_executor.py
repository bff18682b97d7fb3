"""Executor + Gloo transport vs the wire floor, on a GPT-shaped bf16 weight set in a 4-process world.

Run: ``python benchmarks/bench_executor.py [--pattern tp2dp2-tp4] [--iters 7] [--json]``.

Each pattern builds a layout table by hand with Megatron's layouts (source TP×DP as a
``(replicas, tp)`` mesh, vocab-parallel embedding/output, column qkv/fc1 (fc1 gated, stride 2),
row proj/fc2, replicated norms and row biases), plans every rank with ``plan_rank``, and times,
interleaved in the same run:

- **refit**: ``execute_plan`` on warm plans and a kept ``StagingPool`` (what a prepared session
  does); the time of one refit is the slowest rank's, from a common barrier;
- **wire floor**: the same per-pair byte volumes the plan sends, each pair as one message of
  preallocated contiguous bytes, over the same transport (``GlooCopyService``) — no packing, no
  local copies, no landing.

It prints medians over ``--iters`` and their ratio (target: ≤ 1.25), each rank's median phase
seconds (``ExecStats``), per-pair volumes, and checks every destination byte after the last
refit. ``--profile DIR`` writes a cProfile of rank 0's timed refits. No assertions on time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from reshard_core.execute import ExecStats, StagingPool, execute_plan
from reshard_core.execute.check import region
from reshard_core.layout import Layout, Mesh, Replicate, Shard
from reshard_core.plan.ops import OpKind, RankPlan
from reshard_core.plan.rank import plan_rank
from reshard_core.plan.table import LayoutTable, TableBuilder
from reshard_core.specs import TensorMeta
from reshard_core.testing.world import run_world

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
    """One round of single large messages per pair: the slowest rank's seconds, this rank's CPU seconds."""
    dist.barrier()
    cpu, start = cpu_seconds(), time.perf_counter()
    for peer, buf in sends.items():
        transport.submit_send(buf, peer, 0)
    for peer, buf in recvs.items():
        transport.submit_recv(buf, peer, 0)
    transport.run()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return slowest(elapsed), cpu


def time_refit(plan, src, dst, transport, pool, profiler) -> tuple[float, float, dict]:
    """One warm refit: the slowest rank's seconds, this rank's CPU seconds and ``ExecStats``."""
    dist.barrier()
    if profiler is not None:
        profiler.enable()
    cpu, start = cpu_seconds(), time.perf_counter()
    stats = execute_plan(plan, src, dst, transport, pool=pool, **plan_kwargs())
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if profiler is not None:
        profiler.disable()
    return slowest(elapsed), cpu, asdict(stats)


def plan_kwargs() -> dict:
    """Extra ``execute_plan`` keywords from ``RESHARD_BENCH_EXEC`` (``k=v,...``, ints), for experiments."""
    out = {}
    for item in filter(None, os.environ.get("RESHARD_BENCH_EXEC", "").split(",")):
        key, value = item.split("=")
        out[key] = int(value)
    return out


def announce_timing(rank: int) -> None:
    """Write every rank's pid to ``$RESHARD_BENCH_MARK`` as timing starts (to attach a profiler)."""
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    path = os.environ.get("RESHARD_BENCH_MARK")
    if path and rank == 0:
        with open(path, "w") as f:
            f.write(",".join(map(str, pids)))


def _rank_main(rank: int, world: int, opts: dict) -> dict:
    from reshard_gloo.transport import GlooCopyService

    torch.set_num_threads(opts["threads"])
    shape = Shape(**opts["shape"])
    src_side, dst_side = PATTERNS[opts["pattern"]]
    table = build_table(shape, src_side, dst_side)
    t0 = time.perf_counter()
    plan = plan_rank(table, rank, max_batch_bytes=opts["max_batch_bytes"])
    plan_s = time.perf_counter() - t0
    src = locals_of(table, rank, "src", fill=True)
    dst = locals_of(table, rank, "dst", fill=False)
    send_vol, recv_vol = pair_volumes(plan)
    floor_send = {p: torch.empty(n, dtype=torch.uint8) for p, n in sorted(send_vol.items())}
    floor_recv = {p: torch.empty(n, dtype=torch.uint8) for p, n in sorted(recv_vol.items())}
    for buf in (*floor_send.values(), *floor_recv.values()):
        buf.fill_(1)  # touch every page once, as the pool's warm buffers are
    transport = GlooCopyService(timeout=opts["timeout"])
    pool = StagingPool()
    profiler = cProfile.Profile() if opts["profile"] and rank == 0 else None
    for _ in range(opts["warmup"]):
        time_floor(transport, floor_send, floor_recv)
        time_refit(plan, src, dst, transport, pool, None)
    announce_timing(rank)
    floors, refits, stats, cpu_floor, cpu_refit = [], [], [], [], []
    for _ in range(opts["iters"]):
        skip = opts["only"] == "refit"
        seconds, cpu = (0.0, 0.0) if skip else time_floor(transport, floor_send, floor_recv)
        floors.append(seconds)
        cpu_floor.append(cpu)
        if opts["only"] == "floor":
            refits.append(0.0)
            cpu_refit.append(0.0)
            stats.append(asdict(ExecStats()))
            continue
        seconds, cpu, st = time_refit(plan, src, dst, transport, pool, profiler)
        refits.append(seconds)
        cpu_refit.append(cpu)
        stats.append(st)
    if profiler is not None:
        os.makedirs(opts["profile"], exist_ok=True)
        profiler.dump_stats(os.path.join(opts["profile"], f"refit_rank{rank}.prof"))
    bad = verify(table, rank, dst) if opts["verify"] else None
    transport.close()
    phases = {k: statistics.median(s[k] for s in stats) for k in stats[0] if k.startswith("seconds_")}
    counts = {k: v for k, v in stats[-1].items() if not k.startswith("seconds_")}
    return dict(
        rank=rank, floors=floors, refits=refits, phases=phases, counts=counts, sends=send_vol,
        recvs=recv_vol, plan_seconds=plan_s, ops=len(plan.ops), batches=plan.num_batches, bad=bad,
        src_bytes=sum(t.nbytes for t in src.values()), dst_bytes=sum(t.nbytes for t in dst.values()),
        pool_bytes=pool.held_bytes, cpu_floor=statistics.median(cpu_floor),
        cpu_refit=statistics.median(cpu_refit),
    )  # fmt: skip


RANK_KEYS = (
    "rank", "phases", "counts", "sends", "recvs", "plan_seconds", "ops", "batches", "bad", "pool_bytes",
    "cpu_floor", "cpu_refit",
)  # fmt: skip


def summarize(results: list[dict], opts: dict) -> dict:
    floors = results[0]["floors"]
    refits = results[0]["refits"]
    floor, refit = statistics.median(floors), statistics.median(refits)
    paired = None
    if min(floors) > 0 and min(refits) > 0:
        paired = statistics.median(r / f for r, f in zip(refits, floors, strict=True))
    model_bytes = sum(
        TensorMeta(n, s, BF16).numel * 2 for n, s, _, _ in gpt_weights(Shape(**opts["shape"]))
    )  # fmt: skip
    return dict(
        pattern=opts["pattern"], model_gb=model_bytes / 1e9, max_batch_bytes=opts["max_batch_bytes"],
        threads=opts["threads"], refit_s=refit, floor_s=floor,
        ratio=refit / floor if floor > 0 and refit > 0 else None, paired_ratio=paired,
        refit_all=refits, floor_all=floors,
        wire_bytes=sum(sum(r["sends"].values()) for r in results),
        cpu_floor_s=sum(r["cpu_floor"] for r in results), cpu_refit_s=sum(r["cpu_refit"] for r in results),
        local_bytes=sum(r["counts"]["bytes_local"] for r in results),
        ranks=[{k: r[k] for k in RANK_KEYS} for r in results],
    )  # fmt: skip


def print_report(s: dict) -> None:
    mb = 1e6
    print(f"pattern {s['pattern']}: {s['model_gb']:.3f} GB bf16, max_batch_bytes={s['max_batch_bytes']}, "
          f"threads/rank={s['threads']}")  # fmt: skip
    print(f"  wire {s['wire_bytes'] / mb:.1f} MB over all pairs, local copies {s['local_bytes'] / mb:.1f} MB")
    print("  refit  s: " + " ".join(f"{x:.3f}" for x in s["refit_all"]))
    print("  floor  s: " + " ".join(f"{x:.3f}" for x in s["floor_all"]))
    ratio = "n/a (nothing on the wire)" if s["ratio"] is None else f"{s['ratio']:.2f}"
    paired = "n/a" if s["paired_ratio"] is None else f"{s['paired_ratio']:.2f}"
    print(f"  median refit {s['refit_s']:.3f} s, wire floor {s['floor_s']:.3f} s, "
          f"ratio {ratio} (median of paired ratios {paired})")  # fmt: skip
    print(f"  CPU seconds, all ranks (medians): refit {s['cpu_refit_s']:.3f}, floor {s['cpu_floor_s']:.3f}")
    for r in s["ranks"]:
        ph = r["phases"]
        sends = ", ".join(f"→{p}: {n / mb:.1f}" for p, n in sorted(r["sends"].items())) or "-"
        print(
            f"  rank {r['rank']}: cpu {r['cpu_refit']:.3f}/{r['cpu_floor']:.3f} "
            f"total {ph['seconds_total']:.3f} pack {ph['seconds_pack']:.3f} "
            f"transfer {ph['seconds_transfer']:.3f} local {ph['seconds_local']:.3f} "
            f"unpack {ph['seconds_unpack']:.3f} | sends MB {sends} | local "
            f"{r['counts']['bytes_local'] / mb:.1f} MB | msgs {r['counts']['messages_sent']} "
            f"batches {r['batches']} ops {r['ops']} | staging peak "
            f"{r['counts']['peak_staging_bytes'] / mb:.1f} MB | verify {'ok' if r['bad'] == 0 else r['bad']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", action="append", choices=sorted(PATTERNS), help="default: tp2dp2-tp4")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batch-bytes", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--profile", default=None, help="directory for rank 0's cProfile of the timed refits")
    ap.add_argument("--only", choices=("refit", "floor"), help="time one side only (for profilers)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shape = dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, ffn=args.ffn)
    summaries = []
    for pattern in args.pattern or ["tp2dp2-tp4"]:
        opts = dict(
            pattern=pattern, shape=shape, iters=args.iters, warmup=args.warmup, threads=args.threads,
            max_batch_bytes=args.max_batch_bytes, timeout=args.timeout, verify=args.verify,
            profile=args.profile, only=args.only,
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
