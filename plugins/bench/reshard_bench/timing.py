"""Timing collectives fairly: every rank starts together, the slowest rank's time counts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def timed(fn: Callable[[], Any], group: Any = None) -> tuple[Any, float]:
    """``(fn(), seconds)``: ranks of ``group`` start after a barrier; the seconds are the slowest
    rank's (one all-reduce after the call). Collective over ``group``."""
    dist.barrier(group=group)
    start = time.perf_counter()
    value = fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return value, float(elapsed.item())


def median(values: list[float]) -> float:
    """The median (0.0 for no values)."""
    return statistics.median(values) if values else 0.0
