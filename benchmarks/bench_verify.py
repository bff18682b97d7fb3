"""What ``verify=True`` costs: warm refits with and without verified arrivals, same models, same run.

Run: ``python benchmarks/bench_verify.py [--pair tp=2->tp=4] [--size bench] [--world 4] [--reps 7]
[--json]``.

One Gloo world on loopback; the pure-torch GPT of ``reshard_bench`` (``--size bench``: hidden
1024, 8 layers, vocab 32000, 0.38 GB in bf16) in the ``--pair`` layouts (source Megatron-style,
destination declared). Two prepared sessions on the same models, ``prepare(...)`` and
``prepare(..., verify=True)`` (same plan, same transport), each warmed once; then, per repetition,
one plain and one verified ``Session.refit()`` back to back (so the machine's drift hits both
alike), each timed as the slowest rank's seconds from a common barrier. Prints the medians, the
ratio of medians (verified / plain) and the median of per-repetition ratios, the bytes every rank
checked (``RefitReport.verified_bytes``, against received + local), and checks every destination
element after the timed loop. No assertions on time.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from reshard_bench.gpt import PRESETS
from reshard_bench.layouts import resolve_layout
from reshard_bench.pairs import build_pair
from reshard_bench.refit_bench import parse_pair
from reshard_bench.timing import timed

from reshard_core.testing.world import run_world

SEED = 4321
COUNTS = ("verified_bytes", "received_and_local_bytes", "verified_messages", "bytes_sent")


def bench_rank(rank: int, world: int, pair: str, size: str, reps: int) -> dict:
    """On every rank: build the pair, time ``reps`` plain and verified warm refits (interleaved)."""
    import reshard_core

    src_text, dst_text = parse_pair(pair)
    models = build_pair(
        "gpt", PRESETS[size], resolve_layout(src_text, world), resolve_layout(dst_text, world),
        torch.bfloat16, seed=SEED,
    )  # fmt: skip
    sessions = {
        "plain": reshard_core.prepare(models.src, models.dst, timeout=120),
        "verified": reshard_core.prepare(models.src, models.dst, timeout=120, verify=True),
    }
    for session in sessions.values():
        session.refit()
    seconds: dict[str, list[float]] = {name: [] for name in sessions}
    reports = {}
    for _ in range(reps):
        for name, session in sessions.items():
            reports[name], elapsed = timed(session.refit)
            seconds[name].append(elapsed)
    last = reports["verified"]
    totals = torch.tensor(
        [last.verified_bytes, last.bytes_received + last.bytes_local, last.verified_messages, last.bytes_sent]
    )
    dist.all_reduce(totals)
    wrong = models.check()
    return {
        "seconds": seconds,
        "verified_bytes": int(totals[0]),
        "received_and_local_bytes": int(totals[1]),
        "verified_messages": int(totals[2]),
        "bytes_sent": int(totals[3]),
        "wrong": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="tp=2->tp=4")
    parser.add_argument("--size", default="bench", choices=sorted(PRESETS))
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results = run_world(bench_rank, args.world, args.pair, args.size, args.reps, timeout=600, pg_timeout=300)
    out = results[0]
    wrong = [line for r in results for line in r["wrong"]]
    plain, verified = out["seconds"]["plain"], out["seconds"]["verified"]
    summary = {
        "pair": args.pair,
        "size": args.size,
        "world": args.world,
        "reps": args.reps,
        "plain_seconds": statistics.median(plain),
        "verified_seconds": statistics.median(verified),
        "ratio_of_medians": statistics.median(verified) / statistics.median(plain),
        "median_of_ratios": statistics.median(v / p for v, p in zip(verified, plain, strict=True)),
        "plain_runs": plain,
        "verified_runs": verified,
        **{k: out[k] for k in COUNTS},
        "wrong": wrong,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        mib = 2**20
        print(f"{args.pair}, GPT '{args.size}' bf16, {args.world} ranks, Gloo on loopback, {args.reps} reps")
        print(f"  plain refit     {summary['plain_seconds']:.3f} s (median)")
        print(f"  verified refit  {summary['verified_seconds']:.3f} s (median)")
        print(f"  verified / plain: {summary['ratio_of_medians']:.2f}x (ratio of medians), "
              f"{summary['median_of_ratios']:.2f}x (median of per-rep ratios)")  # fmt: skip
        checked, messages = summary["verified_bytes"] / mib, summary["verified_messages"]
        moved, sent = summary["received_and_local_bytes"] / mib, summary["bytes_sent"] / mib
        print(f"  checked {checked:.1f} MiB in {messages} messages + local copies "
              f"(received + local: {moved:.1f} MiB; sent {sent:.1f} MiB)")  # fmt: skip
        print(f"  destinations: {'exact' if not wrong else 'WRONG: ' + '; '.join(wrong[:5])}")
    if wrong:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
