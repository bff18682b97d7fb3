"""A refit's failure board: a rank that fails leaves its error in the group's store, and peers
waiting for it read it and raise at once, with that rank's own words.

Without it, a rank that raises on its own (a destination that is no module, a transform whose
``prepare_send`` fails) leaves its peers waiting in a collective or a receive until the timeout,
after which they can only say that it did not join. ``watched(group)`` wraps each refit call on a
rank: it publishes any error the body raises that is neither a peer's (``TransportError``) nor one
every rank raises alike (``raised_alike``), and at the rank's next call on that group it takes its
record down again. A record therefore stands exactly
while its rank is out of the group's refits: failed and gone, or failed and not back yet. A peer
accepts a record only once it has stood for ``CONFIRM`` seconds, so a rank that failed alone and is
already on its way into the peer's refit (its own call raised before any communication) is never
reported. ``wait_for`` runs a blocking wait on a helper thread while the calling thread checks the
board every ``POLL`` seconds, and raises ``PeerFailed`` naming the rank and its error.

Only failures write to the store, plus ``on_slow``: a wait still blocked after its first tick may
mark itself (``bounded.wait`` does, so that at the deadline the ranks that never joined are told
apart at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as _Pending
from contextlib import contextmanager
from typing import Any

from ..errors import ReshardError, TransportError
from ..refit_group import RefitGroup, view_of

POLL = 0.05
"""Seconds between two looks at the board while a wait blocks."""

CONFIRM = 0.3
"""Seconds a peer's record must stand before it is taken as that peer's failure."""

_FIRST_TICK = 0.02
_MAX_TEXT = 2000
_active: set[Hashable] = set()  # keys of the groups a refit call runs on, on this rank
_published: set[Hashable] = set()  # keys of the groups this rank left a record on
_waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="reshard-wait")
_lock = threading.Lock()


class PeerFailed(TransportError):
    """A peer published its own error while this rank waited for it."""


@contextmanager
def watched(group: Any) -> Iterator[None]:
    """Run one refit call (collective over ``group``) under the board: this rank's record from an
    earlier call is taken down first; an exception other than a ``TransportError`` is published for
    the peers, then re-raised."""
    try:
        view = view_of(group)
    except TransportError:  # no group to publish on (torch.distributed not set up): the body says so
        yield
        return
    if view.key in _published:
        _retract(view)
    with _lock:
        _active.add(view.key)
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, TransportError) and not getattr(exc, "raised_alike", False):
            publish(view, exc)
        raise
    finally:
        with _lock:
            _active.discard(view.key)


@contextmanager
def raised_alike() -> Iterator[None]:
    """Errors raised inside are raised alike by every rank, after an agreement round (a verdict, a
    plan every rank validates): no peer waits for this rank, so ``watched`` does not publish them
    (a record would outlive the refit and stand in the way of the next one)."""
    try:
        yield
    except ReshardError as exc:
        exc.raised_alike = True  # type: ignore[attr-defined]
        raise


def publish(view: RefitGroup, exc: BaseException) -> None:
    """Leave ``exc`` on ``view``'s board (best effort: without a store, peers time out)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:_MAX_TEXT]
    try:
        store = view.store()
        store.set(_prefix(view) + str(view.rank), text.encode())
        if view.key not in _published:
            store.add(_prefix(view) + "count", 1)
            _published.add(view.key)
    except Exception:
        pass


def _retract(view: RefitGroup) -> None:
    _published.discard(view.key)
    try:
        store = view.store()
        store.delete_key(_prefix(view) + str(view.rank))
        store.add(_prefix(view) + "count", -1)
    except Exception:
        pass


def failed_peers(view: RefitGroup) -> dict[int, str]:
    """``{rank: error text}`` of the peers whose records stand on ``view``'s board now (empty
    outside a refit call, without a store, or when the store cannot be read)."""
    store = view.store() if view.key in _active else None
    if store is None:
        return {}
    prefix = _prefix(view)
    found = {}
    try:
        if store.add(prefix + "count", 0) <= 0:
            return {}
        for r in view.ranks:
            if r != view.rank and store.check([prefix + str(r)]):
                found[r] = store.get(prefix + str(r)).decode()
    except Exception:  # the store's host is gone (or a record was just taken down)
        return found
    return found


def wait_for(
    block: Callable[[], None],
    view: RefitGroup,
    what: str | Callable[[], str],
    on_slow: Callable[[], None] | None = None,
) -> None:
    """Run ``block`` (a wait that ends by itself, at the latest at its own deadline) and return or
    raise as it does; raise ``PeerFailed`` ("rank R: <what>: rank P failed: <its error>") as soon as
    a peer publishes (``what`` may be a callable, evaluated only then). Outside a watched refit, or
    without a store, just runs ``block``."""
    if view.key not in _active or view.store() is None:
        block()
        return
    done = _waiters.submit(block)
    board = _Board(view, what)
    slow = False
    while True:
        try:
            done.result(timeout=POLL if slow else _FIRST_TICK)
            return
        except _Pending:
            pass
        except Exception as exc:  # a peer that published and left closes its connections at once
            board.raise_confirmed(at_once=True, cause=exc)
            raise
        if not slow and on_slow is not None:
            on_slow()
        slow = True
        board.raise_confirmed()


class _Board:
    """One wait's view of the board: when each standing record was first seen."""

    def __init__(self, view: RefitGroup, what: str | Callable[[], str]) -> None:
        self.view, self.what = view, what
        self.seen: dict[tuple[int, str], float] = {}

    def raise_confirmed(self, at_once: bool = False, cause: BaseException | None = None) -> None:
        """Raise ``PeerFailed`` for the records that stood ``CONFIRM`` seconds, or for every standing
        record ``at_once`` (the wait broke: a peer that left with a record is not coming back)."""
        now = time.monotonic()
        standing = failed_peers(self.view)
        self.seen = {k: t for k, t in self.seen.items() if k in standing.items()}
        for item in standing.items():
            self.seen.setdefault(item, now)
        confirmed = sorted(k for k, t in self.seen.items() if at_once or now - t >= CONFIRM)
        if confirmed:
            texts = "; ".join(f"rank {r} failed: {text}" for r, text in confirmed)
            what = self.what() if callable(self.what) else self.what
            raise PeerFailed(f"rank {self.view.rank}: {what}: {texts}") from cause


def _prefix(view: RefitGroup) -> str:
    return f"reshard/failed/{','.join(map(str, view.ranks[:8]))}/{len(view.ranks)}/"
