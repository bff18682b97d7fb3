"""One thread per process that reads the failure board for waits blocked on their own thread.

A Gloo point-to-point wait cannot be taken in steps (a receive whose wait times out closes its
pairs), so the calling thread blocks in it for the whole round. To still end such a round as soon
as a peer publishes its error, the calling thread registers the wait here (``watching``) with a
``breaker``: when the watcher thread finds a confirmed record on the board for a wait that has been
blocked past its first tick, it keeps the error and calls ``breaker()``, which makes the blocked
wait raise (for Gloo: a 1 ms wait on a pending request, whose timeout closes the pairs). The
calling thread then raises the watcher's error instead of its own. Nothing crosses threads on a
round that ends within its first tick but the registration itself.

At exit the watcher is stopped and joined (``stop``, then ``join``, from ``failures``' exit
sequence): a breaker may still be inside its wait (a Gloo wait whose pair is busy returns when the
peer closes it), and a thread that returns from native code while the interpreter shuts down aborts
the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import TransportError
from . import failures


@dataclass(eq=False)
class Watch:
    """One blocked wait: its board, what breaks it, when it began, and the error that ended it."""

    board: failures.Board
    breaker: Callable[[], None]
    on_slow: Callable[[], None] | None
    began: float = field(default_factory=time.monotonic)
    slow: bool = False
    error: TransportError | None = None


_watches: set[Watch] = set()
_cv = threading.Condition()
_thread: threading.Thread | None = None
_stopping = False


@contextmanager
def watching(board: failures.Board, breaker: Callable[[], None],
             on_slow: Callable[[], None] | None = None) -> Iterator[Watch]:  # fmt: skip
    """Watch ``board`` while the body blocks; ``Watch.error`` is set when the watcher broke it."""
    global _thread
    watch = Watch(board, breaker, on_slow)
    with _cv:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="reshard-board", daemon=True)
            _thread.start()
            failures.end_at_exit(stop, join)
        _watches.add(watch)
        _cv.notify()
    try:
        yield watch
    finally:
        with _cv:
            _watches.discard(watch)


def stop() -> None:
    """The watcher looks at nothing more, and its thread ends after its current look."""
    global _stopping
    with _cv:
        _stopping = True
        _cv.notify_all()


def join(seconds: float) -> None:
    """Wait for the watcher thread to end (after ``stop``), at most ``seconds``."""
    if _thread is not None:
        _thread.join(seconds)


def _run() -> None:
    while True:
        with _cv:
            while not _watches and not _stopping:
                _cv.wait()
            if _stopping:
                return
            watches = list(_watches)
        now = time.monotonic()
        for watch in watches:
            if now - watch.began >= failures.FIRST_TICK and watch.error is None:
                _look(watch)
        time.sleep(failures.FIRST_TICK if any(not w.slow for w in watches) else failures.POLL)


def _look(watch: Watch) -> None:
    """One look at the board for ``watch``: break its wait when a peer's failure is confirmed."""
    if not watch.slow:
        watch.slow = True
        if watch.on_slow is not None:
            watch.on_slow()
    try:
        watch.board.raise_confirmed()
    except TransportError as exc:
        with _cv:
            if watch not in _watches:  # the wait ended meanwhile
                return
            watch.error = exc
        try:
            watch.breaker()
        except Exception:  # best effort: the wait ends at its own deadline at the latest
            pass
