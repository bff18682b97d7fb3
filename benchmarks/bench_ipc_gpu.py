"""A colocated refit on one GPU over ``ipc`` (two processes, as a trainer rank and an engine worker
sharing a device) against a device memcpy of the same bytes, in one run. Needs CUDA.

    python benchmarks/bench_ipc_gpu.py [--mib 512] [--reps 5]

Prints, with CUDA IPC handles and staged through the host ring, the GB/s of the warm refit (bytes
that crossed between the two processes over the slowest rank's time) and of ``torch.Tensor.copy_``
on the device, and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from reshard_core.testing.world import run_world


def _rank(rank: int, world: int, mib: int, reps: int) -> dict:
    import torch.distributed as dist
    from torch import nn

    import reshard_core

    torch.cuda.set_device(0)
    rows = mib * (1 << 20) // (2 * 4096)  # bf16 rows of 4096
    src, dst = nn.Module(), nn.Module()
    src.w = nn.Parameter(torch.randn(rows // 2, 4096, device="cuda").bfloat16())
    dst.w = nn.Parameter(torch.zeros(rows, 2048, dtype=torch.bfloat16, device="cuda"))
    reshard_core.declare_layout(src.w, dim=0, ranks=(0, 1))
    reshard_core.declare_layout(dst.w, dim=1, ranks=(0, 1))
    session = reshard_core.prepare(src, dst, transport="ipc", timeout=120)
    session.refit()
    times, moved = [], 0
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        report = session.refit()
        torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
        moved = report.bytes_received
    a = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    memcpy = (time.perf_counter() - start) / reps
    return {"refit_s": sorted(times)[len(times) // 2], "memcpy_s": memcpy, "bytes": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="destination MiB in bf16")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ipc_gpu: needs a CUDA GPU")
    for mode, flag in (("CUDA IPC handles", "1"), ("staged through the host ring", "0")):
        out = run_world(_rank, 2, args.mib, args.reps, timeout=900, env={"RESHARD_IPC_CUDA": flag})[0]
        refit_gbs = out["bytes"] / out["refit_s"] / 1e9
        memcpy_gbs = (args.mib << 20) / out["memcpy_s"] / 1e9
        print(f"colocated refit over ipc, {mode}: {out['refit_s'] * 1e3:.1f} ms, {refit_gbs:.2f} GB/s "
              f"across processes; device memcpy of {args.mib} MiB: {memcpy_gbs:.1f} GB/s; "
              f"ratio {refit_gbs / memcpy_gbs:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
