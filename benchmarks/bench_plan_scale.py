"""Planning at scale: reshard's compact exchange and per-rank planner vs Megatron-Core's approach.

Run: ``python benchmarks/bench_plan_scale.py [--sample N] [--megatron-sample K] [--json]``.

Case (issue 3): DeepSeek-V3 shapes, source TP1×PP16×EP64 on 1024 ranks → destination TP8×EP32 on
256 disjoint ranks; then the same with 8192 source ranks (DP8). For each it reports

- reshard: the compact layout table every rank receives (sum of all payloads + size words, the
  uneven all-gather; and the padded figure for backends without one), and the plan time of the
  slowest planned rank (a spread sample plus the busiest candidates, each planned cold; the
  slowest re-planned 3 times, median), with the validity check over the planned ranks;
- Megatron-Core (``megatron.core.resharding``, 0.16.1): every rank builds one ``ParameterMetadata``
  per local parameter (shape, dtype, TP/EP/DP/PP group rank lists) and ``all_gather_object`` the
  lists (pickled; each rank receives ``world × largest payload`` per side) — built here for every
  simulated rank and pickled exactly; then it indexes them by name and replays the global schedule
  (every destination rank, every parameter: pick a source replica, cut LCM micro-tiles) — its own
  planner functions run here for a sample of destination ranks, extrapolated to all of them.

Targets: metadata ≤ 4 MB and the busiest rank planned in ≤ 0.5 s on one core. Times are process
CPU seconds (single-threaded Python, so one core), which stay meaningful on a shared machine. No
assertions: it prints the numbers and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from reshard_core.catalogue import get_model
from reshard_core.catalogue.shapes import ModelShapes
from reshard_core.plan.rank import plan_rank
from reshard_core.simulate.layouts import build_table
from reshard_core.simulate.parallel import Parallel, parse_parallel
from reshard_core.simulate.run import fresh, simulate

CASES = [
    ("deepseek-v3", "tp=1,pp=16,ep=64", "tp=8,ep=32", 1024),
    ("deepseek-v3", "tp=1,pp=16,ep=64,dp=8", "tp=8,ep=32", 8192),
]


TP_DIM = {"column": 0, "vocab": 0, "strided": 0, "row": 1}


@dataclass
class MegatronCost:
    metadata_bytes_sum: int  # all pickled per-rank lists, both sides
    metadata_bytes_received: int  # what all_gather_object moves to each rank (padded to the largest)
    index_seconds: float  # building the name -> metadata maps over every rank's lists
    replay_seconds: float  # extrapolated replay of every destination rank
    replay_sampled: int
    replay_ranks: int


class Grid:
    """Megatron's rank order on one side: tp fastest, then cp, ep, pp, then fsdp·dp (as ``Parallel``)."""

    def __init__(self, par: Parallel, offset: int) -> None:
        if par.expert_tp != par.tp or par.cp != 1 or par.fsdp != 1:
            raise ValueError("the Megatron baseline supports etp == tp, cp == 1 and no fsdp")
        self.p, self.offset = par, offset

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        r = rank - self.offset
        tp, r = r % self.p.tp, r // self.p.tp
        ep, r = r % self.p.ep, r // self.p.ep
        pp, dp = r % self.p.pp, r // self.p.pp
        return tp, ep, pp, dp

    def rank(self, tp: int, ep: int, pp: int, dp: int) -> int:
        p = self.p
        return self.offset + tp + p.tp * (ep + p.ep * (pp + p.pp * dp))

    def groups(self, rank: int) -> dict[str, list[int]]:
        tp, ep, pp, dp = self.coords(rank)
        p = self.p
        return {
            "tp": [self.rank(t, ep, pp, dp) for t in range(p.tp)],
            "ep": [self.rank(tp, e, pp, dp) for e in range(p.ep)],
            "dp": [self.rank(tp, e, pp, d) for d in range(p.dp) for e in range(p.ep)],
            "pp": [self.rank(tp, ep, s, dp) for s in range(p.pp)],
        }


def by_stage(model: ModelShapes, par: Parallel) -> dict[tuple[int, int | None], list]:
    """Tensors per (pipeline stage, EP rank or None for dense)."""
    per_ep = model.num_experts // par.ep if model.num_experts else 0
    out: dict[tuple[int, int | None], list] = {}
    for t in model.tensors:
        stage = par.stage_of_layer(t.layer, model.num_layers)
        out.setdefault((stage, None if t.expert is None else t.expert // per_ep), []).append(t)
    return out


def rank_metadata(model: ModelShapes, grid: Grid, rank: int, stages: dict, share_lists: bool = False) -> list:
    """The ``ParameterMetadata`` list Megatron's ``extract_param_metadata`` makes on ``rank``."""
    from megatron.core.resharding.utils import ParameterMetadata

    tp, ep, pp, _ = grid.coords(rank)
    p = grid.p
    groups = grid.groups(rank)
    copy = (lambda x: x) if share_lists else list  # get_process_group_ranks returns new lists
    out = []
    for t in stages.get((pp, None), []) + stages.get((pp, ep), []):
        dim = TP_DIM.get(t.kind)
        shape = list(t.shape)
        if dim is not None:
            shape[dim] //= p.tp
        meta = ParameterMetadata(
            name=t.name,
            shape=tuple(shape),
            dtype=t.dtype,
            element_size=t.dtype.itemsize,
            is_tp=dim is not None,
            partition_dim=dim or 0,
            partition_stride=2 if t.kind == "strided" else 1,
            is_ep=t.expert is not None,
            num_experts=model.num_experts or None,
            owner_rank=rank,
            tensor_parallel_group_ranks=copy(groups["tp"]) if dim is not None else None,
            expert_parallel_group_ranks=copy(groups["ep"]) if t.expert is not None else None,
            data_parallel_group_ranks=copy(groups["dp"]),
            pipeline_parallel_group_ranks=copy(groups["pp"]),
        )
        meta.resolved_name, meta.global_expert_index = t.name, t.expert
        out.append(meta)
    return out


def megatron_cost(
    model: ModelShapes, src: Parallel, dst: Parallel, dst_offset: int, sample: int = 4, seed: int = 0
) -> MegatronCost:
    from megatron.core.resharding.planner import _determine_source_ranks_for_dst_param
    from megatron.core.resharding.utils import TransferOp, select_src_metadata_balanced

    sides = {"src": Grid(src, 0), "dst": Grid(dst, dst_offset)}
    world = max(src.world, dst_offset + dst.world)
    total, largest = 0, {"src": 0, "dst": 0}
    by_rank: dict[str, dict[int, list]] = {"src": {}, "dst": {}}
    for side, grid in sides.items():
        stages = by_stage(model, grid.p)
        for r in range(grid.offset, grid.offset + grid.p.world):
            size = len(pickle.dumps(rank_metadata(model, grid, r, stages)))
            total, largest[side] = total + size, max(largest[side], size)
            by_rank[side][r] = rank_metadata(model, grid, r, stages, share_lists=True)
    start = time.process_time()
    src_by_name: dict[str, list] = {}
    dst_maps = {r: {m.resolved_name: m for m in metas} for r, metas in by_rank["dst"].items()}
    for metas in by_rank["src"].values():
        for m in metas:
            src_by_name.setdefault(m.resolved_name, []).append(m)
    index_seconds = time.process_time() - start
    picked = sorted(random.Random(seed).sample(sorted(dst_maps), min(sample, len(dst_maps))))
    gc.freeze()
    start = time.process_time()
    for dst_rank in picked:
        for name, dst_meta in dst_maps[dst_rank].items():
            src_meta = select_src_metadata_balanced(src_by_name[name], dst_meta, dst_rank)
            for src_rank, src_slice, dst_slice in _determine_source_ranks_for_dst_param(
                name, src_meta, dst_meta, dst_rank
            ):
                TransferOp(dst_meta.name, src_rank, False, dst_slice, src_slice, 0)
                TransferOp(src_meta.name, dst_rank, True, src_slice, dst_slice, 0)
    per_rank = (time.process_time() - start) / len(picked)
    gc.unfreeze()
    return MegatronCost(
        metadata_bytes_sum=total,
        metadata_bytes_received=world * (largest["src"] + largest["dst"]),
        index_seconds=index_seconds,
        replay_seconds=per_rank * len(dst_maps),
        replay_sampled=len(picked),
        replay_ranks=len(dst_maps),
    )


def cold_plan_seconds(table, rank: int, repeats: int = 3) -> float:
    """Median CPU seconds of planning ``rank`` from a cold copy of ``table``."""
    times = []
    for _ in range(repeats):
        cold = fresh(table)
        gc.collect()
        gc.freeze()  # a real rank plans in a fresh process: no earlier garbage in its GC passes
        start = time.process_time()
        plan_rank(cold, rank)
        times.append(time.process_time() - start)
        gc.unfreeze()
    return statistics.median(times)


def reshard_cost(model: ModelShapes, src: Parallel, dst: Parallel, offset: int, sample: int) -> dict:
    report = simulate(model, src, dst, dst_offset=offset, sample=sample)
    table = build_table(model, src, dst, offset)
    # the busiest: the three slowest of the sample and the one with the most ops, each re-timed
    by_time = sorted(report.planned, key=lambda s: -s.plan_seconds)[:3]
    candidates = {s.rank: s for s in [*by_time, max(report.planned, key=lambda s: s.ops)]}
    timed = {rank: cold_plan_seconds(table, rank) for rank in candidates}
    busiest = max(timed, key=timed.get)
    return {
        "metadata_bytes": report.metadata_bytes,
        "metadata_bytes_padded": report.metadata_bytes_padded,
        "ranks": report.ranks,
        "ranks_planned": len(report.planned),
        "slowest_rank": busiest,
        "slowest_rank_ops": candidates[busiest].ops,
        "plan_seconds_busiest": timed[busiest],
        "plan_seconds_mean": report.plan_seconds_mean,
        "valid": report.valid,
        "pairs_checked": report.pairs_checked,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=48, help="ranks planned per case (plus the busiest)")
    parser.add_argument("--megatron-sample", type=int, default=4, help="destination ranks Megatron replays")
    parser.add_argument("--no-megatron", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for name, src_text, dst_text, offset in CASES:
        model, src, dst = get_model(name), parse_parallel(src_text), parse_parallel(dst_text)
        ours = reshard_cost(model, src, dst, offset, args.sample)
        row = {
            "model": name,
            "src": src_text,
            "src_ranks": src.world,
            "dst": dst_text,
            "dst_ranks": dst.world,
            "reshard": ours,
        }
        if not args.no_megatron:
            try:
                theirs = megatron_cost(model, src, dst, offset, sample=args.megatron_sample)
            except ImportError as exc:
                row["megatron"] = f"skipped: {exc}"
            else:
                row["megatron"] = asdict(theirs)
                row["ratios"] = {
                    "metadata_received": theirs.metadata_bytes_received / ours["metadata_bytes"],
                    "metadata_sum": theirs.metadata_bytes_sum / ours["metadata_bytes"],
                    "plan_seconds": (theirs.index_seconds + theirs.replay_seconds)
                    / ours["plan_seconds_busiest"],
                }
        results.append(row)
        if not args.json:
            _print(row)
            sys.stdout.flush()
    if args.json:
        print(json.dumps(results, indent=2))


def _print(row: dict) -> None:
    ours = row["reshard"]
    print(
        f"\n== {row['model']}: {row['src']} ({row['src_ranks']} ranks) -> {row['dst']} "
        f"({row['dst_ranks']} disjoint ranks)"
    )
    print(
        f"reshard   metadata every rank receives: {ours['metadata_bytes'] / 1e6:.3f} MB "
        f"(padded all-gather: {ours['metadata_bytes_padded'] / 1e6:.3f} MB)  [target <= 4 MB]"
    )
    print(
        f"reshard   busiest rank plan: {ours['plan_seconds_busiest']:.3f} CPU s "
        f"(rank {ours['slowest_rank']}, "
        f"{ours['slowest_rank_ops']} ops; slowest of 4 candidates, median of 3 cold runs; "
        f"{ours['ranks_planned']} of {ours['ranks']} "
        f"ranks planned, mean {ours['plan_seconds_mean']:.3f} s)  [target <= 0.5 s]"
    )
    print(f"reshard   valid: {ours['valid']} ({ours['pairs_checked']} send/receive pairs checked)")
    theirs = row.get("megatron")
    if isinstance(theirs, str) or theirs is None:
        print(f"megatron  {theirs}")
        return
    print(
        f"megatron  metadata each rank receives (all_gather_object, padded): "
        f"{theirs['metadata_bytes_received'] / 1e6:.1f} MB; all ranks' pickled lists: "
        f"{theirs['metadata_bytes_sum'] / 1e6:.1f} MB"
    )
    print(
        f"megatron  plan: index {theirs['index_seconds']:.2f} + replay {theirs['replay_seconds']:.2f} CPU s "
        f"(replayed {theirs['replay_sampled']} of {theirs['replay_ranks']} destination ranks, extrapolated)"
    )
    r = row["ratios"]
    print(
        f"ratios    metadata {r['metadata_received']:.0f}x (vs pickled sum {r['metadata_sum']:.0f}x), "
        f"plan time {r['plan_seconds']:.0f}x"
    )


if __name__ == "__main__":
    main()
