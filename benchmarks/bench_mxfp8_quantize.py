"""MXFP8 quantization throughput on CPU, against a bare BF16 → FP32 cast of the same tensor in the same run.

Usage: ``python benchmarks/bench_mxfp8_quantize.py [--sizes 4096x4096,8192x1024] [--reps 9] [--threads N]``.
Prints, per size, the best-of-reps seconds and GB/s of bf16 input for:

- ``cast``        ``x.to(torch.float32)``: the baseline the issue names (allocates its 4-byte output);
- ``cast_into``   ``out.copy_(x)`` into a preallocated fp32 tensor (no allocation: a stricter baseline);
- ``quantize``    ``reshard_mxfp8.quantize(x)`` rowwise (allocates data and scale);
- ``into``        ``quantize_into(x, data, scale)`` into persistent buffers (the refit path);
- ``colwise``     ``quantize(x, columnwise=True)``;

and the ratios quantize/cast, into/cast_into (1.0 = as fast as the cast; below 1 = faster).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import reshard_mxfp8 as mx
import torch


def _best_seconds(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Best (minimum) wall time of each function over ``reps`` interleaved rounds.

    Interleaving makes load changes hit all functions alike; the minimum is the least disturbed run on a
    shared machine.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def bench(rows: int, cols: int, reps: int) -> dict[str, object]:
    x = torch.randn(rows, cols, dtype=torch.bfloat16)
    out32 = torch.empty(rows, cols, dtype=torch.float32)
    data, scale = mx.empty_quantized(x.shape)
    fns: dict[str, Callable[[], object]] = {
        "cast": lambda: x.to(torch.float32),
        "cast_into": lambda: out32.copy_(x),
        "quantize": lambda: mx.quantize(x),
        "into": lambda: mx.quantize_into(x, data, scale),
        "colwise": lambda: mx.quantize(x, columnwise=True),
    }
    secs = _best_seconds(fns, reps)
    gbytes = x.numel() * x.element_size() / 1e9
    return {
        "shape": [rows, cols],
        "seconds": secs,
        "gb_per_s": {name: gbytes / s for name, s in secs.items()},
        "ratio_quantize_vs_cast": secs["quantize"] / secs["cast"],
        "ratio_into_vs_cast_into": secs["into"] / secs["cast_into"],
        "ratio_colwise_vs_cast": secs["colwise"] / secs["cast"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4096x4096,8192x1024,1024x14336")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for size in args.sizes.split(","):
        rows, cols = (int(v) for v in size.lower().split("x"))
        results.append(bench(rows, cols, args.reps))
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"GB/s of bf16 input (best of {args.reps})"
    )
    names = ["cast", "cast_into", "quantize", "into", "colwise"]
    print(f"{'shape':>12} " + " ".join(f"{n:>10}" for n in names) + "   q/cast  into/cast_into  col/cast")
    for r in results:
        shape = "x".join(str(v) for v in r["shape"])
        rates = " ".join(f"{r['gb_per_s'][n]:10.2f}" for n in names)
        print(
            f"{shape:>12} {rates}   {r['ratio_quantize_vs_cast']:6.2f}  {r['ratio_into_vs_cast_into']:14.2f}"
            f"  {r['ratio_colwise_vs_cast']:8.2f}"
        )


if __name__ == "__main__":
    main()
