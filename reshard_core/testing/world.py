"""Spawn an N-process ``torch.distributed`` Gloo world on loopback and collect per-rank results.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` inside an initialised Gloo process group, and returns the list of
their return values (rank order); ``run_jobs`` runs several such worlds at once, as separate jobs.
A rank that raises makes ``run_world`` raise ``WorldError`` with every failing rank's traceback; a
world that does not finish within ``timeout`` seconds is killed.
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


def _entry(key, rank, world_size, port, pg_timeout, fn, args, results):
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
        results.put((key, True, value))
    except BaseException as exc:  # report everything, including SystemExit from a test helper
        results.put((key, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
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
    return run_jobs((fn, world_size, args), timeout=timeout, pg_timeout=pg_timeout)[0]


def run_jobs(
    *jobs: tuple[Callable[..., Any], int, tuple], timeout: float = 120.0, pg_timeout: float = 60.0
) -> list[list[Any]]:
    """Run several jobs at once, each ``(fn, world_size, args)`` in a Gloo world of its own (own
    port, own processes, like separate torchrun jobs); return each job's results in rank order.

    Jobs meet only through what ``args`` tells them (e.g. a ``TransferGroup`` address). Failures are
    reported as by ``run_world``, ranks named ``job J rank R`` when there is more than one job.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs: dict[tuple[int, int], Any] = {}
    for j, (fn, world_size, args) in enumerate(jobs):
        port = free_port()
        for r in range(world_size):
            procs[(j, r)] = ctx.Process(
                target=_entry, args=((j, r), r, world_size, port, pg_timeout, fn, tuple(args), results),
                daemon=True,
            )  # fmt: skip
    for p in procs.values():
        p.start()
    out: dict[tuple[int, int], Any] = {}
    failures: dict[tuple[int, int], str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(out) + len(failures) < len(procs):
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                key, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs.values()):
                    break  # every process is gone; nothing more can arrive
                continue
            (out if ok else failures)[key] = value
    finally:
        for p in procs.values():
            p.join(timeout=5)
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    name = (lambda k: f"job {k[0]} rank {k[1]}") if len(jobs) > 1 else (lambda k: f"rank {k[1]}")
    missing = [k for k in procs if k not in out and k not in failures]
    if failures or missing:
        lines = [f"{name(k)} failed:\n{failures[k]}" for k in sorted(failures)]
        died = [k for k in missing if procs[k].exitcode not in (None, 0)]
        if died:
            who = [f"{name(k) if len(jobs) > 1 else k[1]} (exit code {procs[k].exitcode})" for k in died]
            lines.append(("ranks " if len(jobs) == 1 else "") + ", ".join(who) + " died without reporting")
        if len(died) < len(missing):
            stuck = [k[1] if len(jobs) == 1 else name(k) for k in missing if k not in died]
            lines.append(f"ranks {stuck} did not finish within {timeout:.0f} s")
        raise WorldError("\n".join(lines))
    return [[out[(j, r)] for r in range(size)] for j, (_, size, _) in enumerate(jobs)]


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"`` when ``fn()`` returns, else ``"<ReshardError subclass>: <message>"`` (the text a world
    test compares across ranks). Any other exception propagates: it is a bug, not an outcome."""
    from ..errors import ReshardError

    try:
        fn()
    except ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
