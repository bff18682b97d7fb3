"""A local Gloo world whose ranks report progress while they run (for the demo and the benchmark).

``spawn_world(fn, n, *args)`` starts ``n`` processes; rank ``r`` calls ``fn(r, n, events, *args)``
inside an initialised Gloo process group, where ``events.emit(kind, data)`` sends a small picklable
event to the parent at once. The parent hands every event to ``on_event(rank, kind, data)`` as it
arrives and asks ``watchdog()`` about once a second; a watchdog that returns a reason ends the world
(every rank killed) with ``WorldStopped(reason)``. Results come back in rank order. Unlike
``reshard_core.testing.run_world`` this needs no test helpers and streams progress.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from ..testing.world import free_port

ERROR_GRACE_S = 15.0
"""After a rank fails, how long the others get to report their own errors before they are ended."""


class WorldError(RuntimeError):
    """A rank failed, or the world did not finish in time. ``failures``: rank -> first error line."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class WorldStopped(WorldError):
    """The watchdog ended the world; the message is its reason."""


class Events:
    """A rank's channel to the parent."""

    def __init__(self, rank: int, channel: Any) -> None:
        self.rank = rank
        self._channel = channel

    def emit(self, kind: str, data: Any = None) -> None:
        """Send ``(kind, data)`` to the parent now (``data`` must be small and picklable)."""
        self._channel.put((self.rank, "event", (kind, data)))


def _entry(rank, world, port, pg_timeout, threads, fn, args, channel):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        value = fn(rank, world, Events(rank, channel), *args)
        channel.put((rank, "result", value))
    except BaseException as exc:  # report everything, SystemExit included
        channel.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_world(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    on_event: Callable[[int, str, Any], None] | None = None,
    watchdog: Callable[[], str | None] | None = None,
    timeout: float = 600.0,
    pg_timeout: float = 300.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world, events, *args)`` on every rank of a fresh local Gloo world.

    Raises ``WorldError`` when a rank raises (with each failing rank's first error line in
    ``failures`` and the tracebacks in the message) or the world outlives ``timeout`` seconds, and
    ``WorldStopped`` when ``watchdog`` returns a reason. Every rank is ended before it returns.
    """
    ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, pg_timeout, threads, fn, args, channel), daemon=True)
        for r in range(world)
    ]
    # Workers start quiet: import-time library warnings (torch without numpy, megatron without apex)
    # would bury the report.
    quiet = {"PYTHONWARNINGS": "ignore"}
    saved = {k: os.environ.get(k) for k in quiet}
    os.environ.update(quiet)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    stopped: str | None = None
    first_error: float | None = None
    try:
        while len(results) + len(errors) < world:
            if watchdog is not None and (stopped := watchdog()) is not None:
                break
            now = time.monotonic()
            if now > deadline or (first_error is not None and now - first_error > ERROR_GRACE_S):
                break
            try:
                rank, kind, value = channel.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in results and r not in errors:
                        errors[r] = f"exited with code {p.exitcode}"
                if errors and first_error is None:
                    first_error = time.monotonic()
                continue
            if kind == "event":
                if on_event is not None:
                    on_event(rank, *value)
            elif kind == "result":
                results[rank] = value
            else:
                errors[rank] = value
                first_error = first_error if first_error is not None else time.monotonic()
    finally:
        _end(procs, graceful=stopped is None and not errors)
    if stopped is not None:
        raise WorldStopped(stopped)
    if errors or len(results) < world:
        lines = [f"rank {r} failed: {errors[r]}" for r in sorted(errors)]
        late = [r for r in range(world) if r not in results and r not in errors]
        if late:
            lines.append(f"ranks {late} did not finish within {timeout:.0f} s")
        failures = {r: errors[r].splitlines()[0] for r in errors}
        raise WorldError("\n".join(lines), failures)
    return [results[r] for r in range(world)]


def _end(procs: list[Any], graceful: bool) -> None:
    for p in procs:
        p.join(timeout=5 if graceful else 0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
