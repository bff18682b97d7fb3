"""Spawn an N-process ``torch.distributed`` Gloo world on loopback and collect per-rank results.

``run_world(fn, world_size, *args)`` starts ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` inside an initialised Gloo process group, and returns the list of
their return values (rank order); ``run_jobs`` runs several such worlds at once, as separate jobs.
A rank that raises makes ``run_world`` raise ``WorldError`` with every failing rank's traceback; a
world that does not finish within ``timeout`` seconds is killed.

A rank may report progress while it runs with ``emit(kind, data)``: ``run_world(...,
on_event=...)`` hands each event to the parent's ``on_event(rank, kind, data)`` as it arrives, and
a ``watchdog()`` asked between events can end the world with ``WorldStopped(reason)``. This is the
one spawner of the project: tests, examples, ``reshard demo`` and ``reshard bench`` all use it.

Ranks are forked from a multiprocessing fork server that imported ``PRELOAD`` once (``preload``
adds modules), so a rank starts in a fraction of a second rather than importing torch anew. Each
rank still gets what a spawned process would: the parent's environment and ``sys.path`` as they are
when the world starts, and its standard output and error.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp

__all__ = [
    "PRELOAD", "WorldError", "WorldStopped", "emit", "free_port", "outcome", "preload", "run_jobs",
    "run_world",
]  # fmt: skip

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"

PRELOAD: list[str] = ["torch", "torch.distributed", "torch.distributed.fsdp", "reshard_core.api"]
"""Modules the fork server imports once, before it forks the first rank (a module that is not
installed is left out)."""

POLL_S = 0.2
"""How often the parent looks at its ranks (and asks the watchdog) while no message arrives."""

STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)
"""Asks a rank to print every thread's stack to its stderr: sent to the ranks still running when a
world's ``timeout`` ends, before they are killed, so a hang says where it hung."""

_channel: tuple[tuple[int, int], Any] | None = None
"""In a spawned rank: its ``(job, rank)`` key and the queue to the parent (for ``emit``)."""


class WorldError(RuntimeError):
    """One or more ranks of a spawned world failed or timed out. ``failures``: for each rank that
    failed or died (``"rank R"``, or ``"job J rank R"`` when there are several jobs), in rank order,
    the first line of its error or ``"exited with code N"``."""

    def __init__(self, message: str, failures: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class WorldStopped(WorldError):
    """The watchdog ended the world; the message is its reason."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (e.g. a model library every rank imports). Takes
    effect only before the first world of this process starts."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def emit(kind: str, data: Any = None) -> None:
    """From inside a spawned rank: send ``(kind, data)`` (small, picklable) to the parent now. The
    parent's ``on_event`` receives it; without one, or outside a spawned world, it goes nowhere."""
    if _channel is not None:
        key, channel = _channel
        channel.put((key, "event", (kind, data)))


def _entry(key, rank, world_size, port, pg_timeout, fn, args, channel, environ, stdio):
    global _channel
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the fork server's environment is the parent's of when the server started
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    stdio.adopt()
    torch.set_num_threads(1)
    _channel = (key, channel)
    if STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        channel.put((key, "result", value))
    except BaseException as exc:  # report everything, including SystemExit from a test helper
        channel.put((key, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    on_event: Callable[[int, str, Any], None] | None = None,
    watchdog: Callable[[], str | None] | None = None,
    error_grace: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh Gloo world; return the results.

    ``fn`` and ``args`` must be picklable (module-level functions). Return values travel through a
    multiprocessing queue, so keep them small (tensors are fine). ``on_event(rank, kind, data)``
    receives what ranks ``emit``; a ``watchdog()`` that returns a reason ends the world (every rank
    killed) with ``WorldStopped(reason)``; ``error_grace``: seconds the other ranks get to report
    after one failed or died before they are ended (None: they get until ``timeout``); ``env``:
    extra environment variables for the ranks.
    """
    return _run(
        [(fn, world_size, args)], timeout=timeout, pg_timeout=pg_timeout, on_event=on_event,
        watchdog=watchdog, error_grace=error_grace, env=env or {},
    )[0]  # fmt: skip


def run_jobs(
    *jobs: tuple[Callable[..., Any], int, tuple],
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    on_event: Callable[[int, str, Any], None] | None = None,
    watchdog: Callable[[], str | None] | None = None,
) -> list[list[Any]]:
    """Run several jobs at once, each ``(fn, world_size, args)`` in a Gloo world of its own (own
    port, own processes, like separate torchrun jobs); return each job's results in rank order.

    Jobs meet only through what ``args`` tells them (e.g. a ``TransferGroup`` address). Failures are
    reported as by ``run_world``, ranks named ``job J rank R`` when there is more than one job.
    ``on_event`` and ``watchdog``: as for ``run_world`` (``on_event`` receives the rank within its
    job; a rank that needs to be told apart across jobs says who it is in its data).
    """
    return _run(list(jobs), timeout=timeout, pg_timeout=pg_timeout, on_event=on_event, watchdog=watchdog,
                error_grace=None, env={})  # fmt: skip


def _run(
    jobs: list[tuple[Callable[..., Any], int, tuple]],
    *,
    timeout: float,
    pg_timeout: float,
    on_event: Callable[[int, str, Any], None] | None,
    watchdog: Callable[[], str | None] | None,
    error_grace: float | None,
    env: Mapping[str, str],
) -> list[list[Any]]:
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    channel = ctx.Queue()
    environ = {**os.environ, **env}
    procs: dict[tuple[int, int], Any] = {}
    for j, (fn, world_size, args) in enumerate(jobs):
        port = free_port()
        for r in range(world_size):
            procs[(j, r)] = ctx.Process(
                target=_entry,
                args=((j, r), r, world_size, port, pg_timeout, fn, tuple(args), channel, environ, _Stdio()),
                daemon=True,
            )  # fmt: skip
    for p in procs.values():
        p.start()
    out: dict[tuple[int, int], Any] = {}
    failures: dict[tuple[int, int], str] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    stopped: str | None = None
    cut_short = gone = False
    try:
        while len(out) + len(failures) < len(procs):
            if watchdog is not None and (stopped := watchdog()) is not None:
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if error_grace is not None and first_failure is not None and now - first_failure > error_grace:
                cut_short = True
                break
            try:
                key, kind, value = channel.get(timeout=min(deadline - now, POLL_S))
            except queue.Empty:
                if all(k in out or k in failures or not p.is_alive() for k, p in procs.items()):
                    if gone:  # every rank reported or is gone, and the queue stayed empty: nothing more
                        break  # can arrive (a rank that reported may still be tearing down its group)
                    gone = True
                elif first_failure is None and any(p.exitcode not in (None, 0) for p in procs.values()):
                    first_failure = time.monotonic()
                continue
            if kind == "event":
                if on_event is not None:
                    on_event(key[1], *value)
            elif kind == "result":
                out[key] = value
            else:
                failures[key] = value
                first_failure = first_failure if first_failure is not None else time.monotonic()
    finally:
        exit_codes = {k: p.exitcode for k, p in procs.items()}  # read before _end kills the stuck ones
        if stopped is None and not cut_short and time.monotonic() >= deadline:
            _dump_stacks([p for k, p in procs.items() if k not in out and k not in failures])
        _end(list(procs.values()), quick=stopped is not None or cut_short)
    if stopped is not None:
        raise WorldStopped(stopped)
    missing = [k for k in procs if k not in out and k not in failures]
    if failures or missing:
        raise _world_error(len(jobs), exit_codes, failures, missing, timeout)
    return [[out[(j, r)] for r in range(size)] for j, (_, size, _) in enumerate(jobs)]


def _world_error(
    njobs: int, exit_codes: dict[tuple[int, int], int | None], failures: dict[tuple[int, int], str],
    missing: list[tuple[int, int]], timeout: float,
) -> WorldError:  # fmt: skip
    """Every failing rank's traceback, then the ranks that died silently and those still running."""
    name = (lambda k: f"job {k[0]} rank {k[1]}") if njobs > 1 else (lambda k: f"rank {k[1]}")
    lines = [f"{name(k)} failed:\n{failures[k]}" for k in sorted(failures)]
    died = [k for k in missing if exit_codes[k] not in (None, 0)]
    if died:
        who = [f"{name(k) if njobs > 1 else k[1]} (exit code {exit_codes[k]})" for k in died]
        lines.append(("ranks " if njobs == 1 else "") + ", ".join(who) + " died without reporting")
    if len(died) < len(missing):
        stuck = [k[1] if njobs == 1 else name(k) for k in missing if k not in died]
        lines.append(f"ranks {stuck} did not finish within {timeout:.0f} s")
    first_lines = {k: text.splitlines()[0] for k, text in failures.items()}
    first_lines.update({k: f"exited with code {exit_codes[k]}" for k in died})
    return WorldError("\n".join(lines), {name(k): first_lines[k] for k in sorted(first_lines)})


class _Stdio:
    """The parent's standard output and error, carried to a rank as file descriptors (a forked rank
    would else write where the fork server's went: to whatever they were when it started)."""

    def __init__(self, fds: tuple[Any, Any] | None = None) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple:
        return (_Stdio, ((reduction.DupFd(1), reduction.DupFd(2)),))  # only while starting a process

    def adopt(self) -> None:
        """In the rank: make the carried descriptors its fds 1 and 2."""
        assert self.fds is not None, "adopt() runs in the rank, on the unpickled copy"
        for target, carried in zip((1, 2), self.fds, strict=True):
            fd = carried.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _dump_stacks(procs: list[Any]) -> None:
    """Have each rank still running print its threads' stacks (to its stderr), and give it a moment."""
    alive = [p for p in procs if p.is_alive()]
    if STACKS_SIGNAL is None or not alive:
        return
    for p in alive:  # one at a time: their stacks would interleave on the shared stderr
        try:
            os.kill(p.pid, STACKS_SIGNAL)
        except OSError:  # it exited meanwhile
            continue
        time.sleep(0.5)


def _end(procs: list[Any], quick: bool) -> None:
    """Give every process a moment to exit (5 s, or 0.1 s when the world was cut short), then kill it."""
    for p in procs:
        p.join(timeout=0.1 if quick else 5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"`` when ``fn()`` returns, else ``"<ReshardError subclass>: <message>"`` (the text a world
    test compares across ranks). Any other exception propagates: it is a bug, not an outcome."""
    from ..errors import ReshardError

    try:
        fn()
    except ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
