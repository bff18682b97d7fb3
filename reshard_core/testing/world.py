"""Spawn an N-process ``torch.distributed`` Gloo world on loopback and collect per-rank results.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` inside an initialised Gloo process group, and returns the list of
their return values (rank order). A rank that raises makes ``run_world`` raise ``WorldError`` with
every failing rank's traceback; a world that does not finish within ``timeout`` seconds is killed.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed or timed out."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, pg_timeout, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException as exc:  # report everything, including SystemExit from a test helper
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh Gloo world; return the results.

    ``fn`` and ``args`` must be picklable (module-level functions). Return values travel through a
    multiprocessing queue, so keep them small (tensors are fine).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, pg_timeout, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(out) + len(failures) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break  # every process is gone; nothing more can arrive
                continue
            (out if ok else failures)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in out and r not in failures]
    if failures or missing:
        lines = [f"rank {r} failed:\n{failures[r]}" for r in sorted(failures)]
        died = [r for r in missing if procs[r].exitcode not in (None, 0)]
        if died:
            lines.append("ranks " + ", ".join(f"{r} (exit code {procs[r].exitcode})" for r in died)
                         + " died without reporting")
        if len(died) < len(missing):
            stuck = [r for r in missing if r not in died]
            lines.append(f"ranks {stuck} did not finish within {timeout:.0f} s")
        raise WorldError("\n".join(lines))
    return [out[r] for r in range(world_size)]


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"`` when ``fn()`` returns, else ``"<ReshardError subclass>: <message>"`` (the text a world
    test compares across ranks). Any other exception propagates: it is a bug, not an outcome."""
    from ..errors import ReshardError

    try:
        fn()
    except ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
