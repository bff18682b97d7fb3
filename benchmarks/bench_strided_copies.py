"""What a column slice costs to copy against a memcpy of the same bytes, on the bench model's shapes.

Run: ``python benchmarks/bench_strided_copies.py [--reps 41]``.

A row-parallel weight (Megatron's ``linear_proj`` and ``linear_fc2``) is split along its columns, so
every refit that changes its TP degree copies column slices: rows of ``cols / tp`` elements read
(or written) ``cols`` elements apart. ``reshard bench``'s floors copy the same bytes as one
contiguous memcpy. This prints, for the ``bench`` preset (hidden 1024, ffn 4096, bf16) and TP 2 and
4, the median seconds of ``dst.copy_(src[:, a:b])`` (read strided, as a local copy or a sender's
pack does), of ``dst[:, a:b].copy_(src)`` (written strided, as a receiver's unpack does) and of a
memcpy of the same bytes, and their ratios, in one process with one thread. No assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ROWS_AND_COLS = {"linear_proj": (1024, 1024), "linear_fc2": (1024, 4096)}
"""The bench preset's row-parallel weights (rows, full columns)."""


def _median_seconds(pairs: list[tuple[torch.Tensor, torch.Tensor]], reps: int) -> float:
    """Median seconds of copying every ``(dst, src)`` pair once."""

    def copy_all() -> None:
        for dst, src in pairs:
            dst.copy_(src)

    copy_all()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        copy_all()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(name: str, rows: int, cols: int, tp: int, layers: int, reps: int) -> str:
    part = cols // tp
    full = [torch.randn(rows, cols).bfloat16() for _ in range(layers)]
    slices = [torch.empty(rows, part, dtype=torch.bfloat16) for _ in range(layers)]
    flat = [(torch.empty(rows * part).bfloat16(), torch.randn(rows * part).bfloat16()) for _ in range(layers)]
    base = _median_seconds(flat, reps)
    read = _median_seconds([(s, f[:, part : 2 * part]) for s, f in zip(slices, full, strict=True)], reps)
    write = _median_seconds([(f[:, part : 2 * part], s) for s, f in zip(slices, full, strict=True)], reps)
    mb = layers * rows * part * 2 / 1e6
    ratios = f"{read / base:>12.2f}× {write / base:>13.2f}×"
    return f"{name:<12} {tp:>3} {part:>9} {mb:>6.1f} {base * 1e3:>9.2f} {ratios}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--layers", type=int, default=8, help="weights copied per timing (one per layer)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'weight':<12} {'tp':>3} {'row elems':>9} {'MB':>6} {'memcpy ms':>9} ", end="")
    print(f"{'read-strided':>13} {'write-strided':>14}")
    for name, (rows, cols) in ROWS_AND_COLS.items():
        for tp in (2, 4):
            print(_row(name, rows, cols, tp, args.layers, args.reps))


if __name__ == "__main__":
    main()
