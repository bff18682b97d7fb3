"""Calls on a refit group's store that end in time, naming the store's host when it does not answer.

A TCPStore client's ``add`` and ``check`` wait for the answer without any bound: with the process
that hosts the store stalled (SIGSTOP, a debugger, a swapped-out host), every rank asking would
hang there for good. ``call`` runs one store call on a short-lived helper thread and waits for it at
most ``seconds``; a store that did not answer is remembered, so later calls on it fail at once
instead of each waiting again (its helper thread stays blocked until the host answers or dies).
A store whose host exited answers every call at once with a network error: ``call`` raises
``StoreSilent`` for it too, naming the host.

A helper still running when the process exits is released by ``release_helpers`` (called by
``failures``' exit sequence): were the host to die while the interpreter shuts down, the store's
error thrown in that thread could no longer reach Python and would abort the process (``terminate
called without an active exception``, exit -6) after the refit's error was handled. Releasing shuts
the helpers' connections down (Linux: the process's sockets to the store's address), so their calls
fail while Python still runs.

Only failure and slow paths touch the store (the failure board, the marks of a slow wait, the
store-based rounds of a ``TransferGroup``), so the helper thread costs nothing on a refit where
nothing fails.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import TransportError, first_line

T = TypeVar("T")

try:  # a TCPStore whose host is gone raises this on every call (torch >= 2.3)
    from torch.distributed import DistNetworkError as _NetworkError

    _NETWORK_ERRORS: tuple[type[BaseException], ...] = (_NetworkError,)
except Exception:  # older torch: only a silent store is told apart
    _NETWORK_ERRORS = ()

_silent: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""The stores whose host did not answer, with the error to raise at once. Weak keys, not ids: a
store found gone is dropped with its group, and a new group's store may get the same id."""


class StoreSilent(TransportError):
    """A group's store did not answer within the time a refit had left (its host stalled or died),
    or its connection broke (its host exited)."""


@dataclass(frozen=True)
class StoreHost:
    """Who hosts a group's store (``name``, in words) and how to go on once it stopped answering."""

    name: str
    recover: str


def host_of(transfer: Any = None) -> StoreHost:
    """The host of a refit group's store: a transfer group's rank 0 (its convention), torchrun's agent
    (which hosts the default store of a torchrun job), or rank 0 (which ``init_process_group`` makes
    the host otherwise)."""
    if transfer is not None:
        return StoreHost("rank 0", "close the transfer group and join a new one")
    restart = "restart the job (its default store cannot be replaced)"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return StoreHost("torchrun's agent", restart)
    return StoreHost("rank 0", restart)


def call(store: Any, fn: Callable[[Any], T], seconds: float, host: StoreHost) -> T:
    """``fn(store)``, or ``StoreSilent`` when it has not returned after ``seconds`` (or the store was
    found silent before: the group is broken, and the error says how to recover). Exceptions of
    ``fn`` propagate."""
    known = _silent.get(store)
    if known is not None:
        raise StoreSilent(f"{known} (found before); this group cannot refit again: {host.recover}")
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn(store)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append((False, exc))

    helper = threading.Thread(target=run, name="reshard-store", daemon=True)
    _helpers[helper] = store
    helper.start()
    helper.join(max(seconds, 0.0))
    if not outcome:
        text = f"the group's store (hosted by {host.name}) did not answer"
        _silent[store] = text
        raise StoreSilent(f"{text} within {seconds:.3g} s: {host.name} stalled or died")
    ok, value = outcome[0]
    if ok:
        return value
    if isinstance(value, _NETWORK_ERRORS):  # the host closed its end: it exited (or was killed)
        text = f"the group's store (hosted by {host.name}) is gone ({first_line(value)})"
        _silent[store] = text
        raise StoreSilent(f"{text}: {host.name} exited or its connection broke") from value
    raise value


_helpers: weakref.WeakKeyDictionary[threading.Thread, Any] = weakref.WeakKeyDictionary()
"""Every helper thread started, with the store it calls (gone with the thread)."""


def release_helpers(seconds: float = 2.0) -> int:
    """Make every store call still running on a helper thread fail now (its host stalled, or it is
    slow) and wait for those threads, at most ``seconds`` in all; returns how many ran. For exit:
    it breaks this process's connections to those stores."""
    running = [(t, store) for t, store in list(_helpers.items()) if t.is_alive()]
    ports = {port for _, store in running for port in _addresses(store)}
    if ports:
        _shut_down_sockets_to(ports)
    for thread, _ in running:
        thread.join(seconds / len(running))
    return len(running)


def _addresses(store: Any) -> set[int]:
    """The ports of the TCP stores under ``store`` (through prefix stores)."""
    ports = set()
    while store is not None:
        port = getattr(store, "port", None)
        if isinstance(port, int):
            ports.add(port)
        store = getattr(store, "underlying_store", None)
    return ports


def _shut_down_sockets_to(ports: set[int]) -> None:
    """Shut down this process's TCP connections to any of ``ports`` (Linux: found through
    ``/proc/self/fd``); the calls blocked reading them then fail at once."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            peer = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if peer.type == socket.SOCK_STREAM and peer.getpeername()[1] in ports:
                peer.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            peer.close()
