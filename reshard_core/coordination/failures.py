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

A rank that fails because of a peer (a receive from it broke, it never joined) publishes a relay
record naming that peer (``blame``), so ranks that only wait on the relaying rank report the rank
that failed first, not their neighbour; a wait that breaks gives a relay ``RELAY_WAIT`` seconds to
land before it raises its own error.

At exit (``at_exit``), a rank that hosts its group's store and published a failure first waits (at
most ``LINGER`` seconds) until every peer either published a record of its own or is named by one:
a peer still reading the board would otherwise find the store gone with its host, and name the host
instead of the rank that failed first. Then the watcher stops and every store call still running
is released (``watcher``, ``store_calls``), so that no thread returns from native code while the
interpreter shuts down (which aborts the process).

Only failures write to the store, plus ``on_slow``: a wait still blocked after its first tick may
mark itself (``bounded.wait`` does, so that at the deadline the ranks that never joined are told
apart at once). Every store call is bounded (``store_calls``): a board read ends at the wait's own
deadline plus ``GRACE`` at the latest, and a store whose host stopped answering ends the wait with a
``TransportError`` naming that host.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as _Pending
from contextlib import contextmanager
from typing import Any

from ..errors import ReshardError, TransportError
from . import broken
from .refit_group import RefitGroup, view_of
from .store_calls import StoreSilent, call, release_helpers

POLL = 0.05
"""Seconds between two looks at the board while a wait blocks."""

CONFIRM = 0.3
"""Seconds a peer's record must stand before it is taken as that peer's failure."""

GRACE = 1.0
"""Seconds a store call may take beyond the wait's deadline (and at most, to publish or retract)."""

UNBOUNDED = 300.0
"""Seconds a board read may take in a wait without a deadline."""

RELAY_WAIT = 0.3
"""Seconds a broken wait looks for a peer's record before raising its own error (a neighbour that
saw the first failure closes its connections a moment before its record lands)."""

LINGER = 10.0
"""Seconds at most a store-hosting rank that published a failure waits at exit for its peers to
learn of it."""

STOP_WAIT = 5.0
"""Seconds at most the process waits at exit for the watcher thread to end."""

FIRST_TICK = 0.02
"""Seconds a wait blocks before it first looks at the board (most waits end sooner)."""
_MAX_TEXT = 2000
_active: set[Hashable] = set()  # keys of the groups a refit call runs on, on this rank
_published: set[Hashable] = set()  # keys of the groups this rank left a record on
_waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="reshard-wait")
_lock = threading.Lock()


class PeerFailed(TransportError):
    """A peer published its own error while this rank waited for it (``own_error``), or relays
    named the rank that failed first."""

    own_error: bool = False


def blame(exc: TransportError, ranks: Any) -> TransportError:
    """Mark ``exc`` as caused by the peers ``ranks`` (a receive from them broke, they never joined);
    ``watched`` then publishes it as a relay naming them. Returns ``exc``."""
    exc.culprits = tuple(sorted(set(ranks)))  # type: ignore[attr-defined]
    return exc


def _peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer (or the store's host) died or stalled: its waits were abandoned,
    so the group cannot pair its calls again. A peer that raised its own error (``PeerFailed`` with
    its words) took part until then: the transports that failed are closed and rebuilt."""
    if isinstance(exc, PeerFailed) and exc.own_error:
        return False
    return any(isinstance(e, StoreSilent) for e in _chain(exc)) or bool(_culprits(exc))


def _culprits(exc: BaseException) -> tuple[int, ...]:
    """The peers ``exc`` (or an error it was raised from) blames, if any."""
    return next((e.culprits for e in _chain(exc) if getattr(e, "culprits", None)), ())  # type: ignore[attr-defined]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from, newest first."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__


@contextmanager
def watched(group: Any) -> Iterator[None]:
    """Run one refit call (collective over ``group``) under the board: a group an earlier call left
    broken raises at once (``broken``; published for the peers); this rank's record from an earlier
    call is taken down first; an exception other than a ``TransportError`` is published for the
    peers, then re-raised; so is a ``TransportError`` that blames peers (as a relay). Either marks
    the group broken."""
    try:
        view = view_of(group)
    except TransportError:  # no group to publish on (torch.distributed not set up): the body says so
        yield
        return
    try:
        broken.check(view)
    except broken.BrokenGroup as exc:
        # for a peer that did not find the group broken (it failed on its own while this rank gave
        # up on the closing round): it hears it at once instead of waiting out the start round. A
        # record this rank left before (the failure that broke the group) stays: it names the cause
        if view.key not in _published:
            publish(view, exc)
        exc.raised_alike = True  # type: ignore[attr-defined]
        raise
    if view.key in _published:
        _retract(view)
    with _lock:
        _active.add(view.key)
    try:
        yield
    except Exception as exc:
        if not getattr(exc, "raised_alike", False):
            if _peer_gone(exc):
                broken.mark(view, exc)
            culprits = _culprits(exc)
            if culprits or not isinstance(exc, TransportError):
                publish(view, exc, culprits)
        raise
    finally:
        with _lock:
            _active.discard(view.key)


@contextmanager
def raised_alike() -> Iterator[None]:
    """Errors raised inside are raised alike by every rank, after an agreement round (a verdict, a
    plan every rank validates): no peer waits for this rank, so ``watched`` does not publish them
    (a record would outlive the refit and stand in the way of the next one). A round that itself
    failed (a peer died, stalled or failed on its own) is not an error raised alike: it travels."""
    try:
        yield
    except ReshardError as exc:
        if not isinstance(exc, PeerFailed) and not _peer_gone(exc):
            exc.raised_alike = True  # type: ignore[attr-defined]
        raise


def publish(view: RefitGroup, exc: BaseException, culprits: tuple[int, ...] = ()) -> None:
    """Leave ``exc`` on ``view``'s board (best effort: without a store, peers time out); with
    ``culprits``, as a relay: the error is theirs, seen from here."""
    text = ",".join(map(str, culprits)) + "|" + " ".join(f"{type(exc).__name__}: {exc}".split())[:_MAX_TEXT]
    first = view.key not in _published

    def write(store: Any) -> None:
        store.set(_prefix(view) + str(view.rank), text.encode())
        if first:
            store.add(_prefix(view) + "count", 1)

    try:
        call(view.store(), write, GRACE, view.store_host())
        _published.add(view.key)
    except Exception:
        return
    if view.rank == 0 and view.store_host().name == "rank 0":  # this process hosts the store
        _hosted[view.key] = view


def _retract(view: RefitGroup) -> None:
    _published.discard(view.key)

    def take_down(store: Any) -> None:
        store.delete_key(_prefix(view) + str(view.rank))
        store.add(_prefix(view) + "count", -1)

    try:
        call(view.store(), take_down, GRACE, view.store_host())
    except Exception:
        pass


def failed_peers(view: RefitGroup, seconds: float = UNBOUNDED) -> dict[int, str]:
    """``{rank: error text}`` of the peers whose records stand on ``view``'s board now (empty
    outside a refit call, without a store, or when the store cannot be read). Raises ``StoreSilent``
    when the store does not answer within ``seconds``."""
    store = view.store() if view.key in _active else None
    if store is None:
        return {}
    prefix = _prefix(view)

    def read(store: Any) -> dict[int, str]:
        found: dict[int, str] = {}
        try:
            if store.add(prefix + "count", 0) <= 0:
                return found
            for r in view.ranks:
                if r != view.rank and store.check([prefix + str(r)]):
                    found[r] = store.get(prefix + str(r)).decode()
        except Exception:  # the store's host is gone (or a record was just taken down)
            return found
        return found

    return call(store, read, seconds, view.store_host())


def wait_for(
    block: Callable[[], None],
    view: RefitGroup,
    what: str | Callable[[], str],
    timeout: float | None,
    on_slow: Callable[[], None] | None = None,
) -> None:
    """Run ``block`` (a wait that ends by itself, at the latest ``timeout`` seconds from now) and
    return or raise as it does; raise ``PeerFailed`` ("rank R: <what>: rank P failed: <its error>")
    as soon as a peer publishes (``what`` may be a callable, evaluated only then), and
    ``TransportError`` naming the store's host when the board cannot be read by the deadline plus
    ``GRACE``. Outside a watched refit, or without a store, just runs ``block``."""
    if view.key not in _active or view.store() is None:
        block()
        return
    done = _waiters.submit(block)
    board = Board(view, what, None if timeout is None else time.monotonic() + timeout)
    slow = False
    while True:
        try:
            done.result(timeout=POLL if slow else FIRST_TICK)
            return
        except _Pending:
            pass
        except Exception as exc:  # a peer that published and left closes its connections at once
            board.raise_any(exc)
            raise
        if not slow and on_slow is not None:
            on_slow()
        slow = True
        board.raise_confirmed()


def board_for(view: RefitGroup, what: str | Callable[[], str], timeout: float | None) -> Board | None:
    """The board a wait of ``timeout`` seconds on ``view`` reads, or None outside a watched refit
    or without a store (the wait then just blocks)."""
    if view.key not in _active or view.store() is None:
        return None
    return Board(view, what, None if timeout is None else time.monotonic() + timeout)


def wait_in_steps(
    step: Callable[[float], bool],
    view: RefitGroup,
    what: str | Callable[[], str],
    timeout: float | None,
    on_slow: Callable[[], None] | None = None,
) -> bool:
    """Like ``wait_for``, on the calling thread, for a wait that can be taken in steps: ``step(s)``
    waits at most ``s`` seconds and says whether the wait is over (raising what the wait raises).
    Returns False when ``timeout`` passed first. No helper thread: a wait that ends within its first
    step costs nothing more than the wait."""
    board = board_for(view, what, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    first = FIRST_TICK if board is not None else POLL
    left, slow = (None if deadline is None else timeout), False
    while True:
        try:
            if step(first if left is None else min(first, left)):
                return True
        except Exception as exc:  # a peer that published and left closes its connections at once
            if board is not None:
                board.raise_any(exc)
            raise
        if board is not None:
            if not slow and on_slow is not None:
                on_slow()
            board.raise_confirmed()
        first, slow = POLL, True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            if board is not None:
                board.raise_late()
            return False


class Board:
    """One wait's view of the board: when each standing record was first seen. Read by the waiting
    thread (``wait_for``, ``wait_in_steps``) or by the watcher thread (``watcher``)."""

    def __init__(self, view: RefitGroup, what: str | Callable[[], str], deadline: float | None) -> None:
        self.view, self.what, self.deadline = view, what, deadline
        self.seen: dict[tuple[int, str], float] = {}

    def raise_confirmed(self, at_once: bool = False, cause: BaseException | None = None) -> None:
        """Raise ``PeerFailed`` for the records that stood ``CONFIRM`` seconds, or for every standing
        record ``at_once`` (the wait broke: a peer that left with a record is not coming back)."""
        now = time.monotonic()
        seconds = UNBOUNDED if self.deadline is None else max(self.deadline - now, 0.0) + GRACE
        try:
            standing = failed_peers(self.view, seconds)
        except StoreSilent as exc:
            raise StoreSilent(f"rank {self.view.rank}: {self._what()}: {exc}") from cause
        self.seen = {k: t for k, t in self.seen.items() if k in standing.items()}
        for item in standing.items():
            self.seen.setdefault(item, now)
        confirmed = sorted(k for k, t in self.seen.items() if at_once or now - t >= CONFIRM)
        mine = set(_culprits(cause)) if cause is not None else set()
        error = self._failed(confirmed, mine) if confirmed else None
        if error is not None:
            raise error from cause

    def raise_any(self, cause: BaseException) -> None:
        """The wait broke with ``cause``: raise ``PeerFailed`` for any record that stands now (a
        peer that left with a record is not coming back, and its store may go with it); else
        publish ``cause`` when it blames peers (a relay) and raise for any record that lands within
        ``RELAY_WAIT``; else return."""
        end = time.monotonic() + RELAY_WAIT
        self.raise_confirmed(at_once=True, cause=cause)
        culprits = _culprits(cause)
        if culprits:
            publish(self.view, cause, culprits)
        self._read_until(end, cause)

    def raise_late(self) -> None:
        """The wait timed out: raise ``PeerFailed`` for any record that stands now or lands within
        ``RELAY_WAIT`` (a peer that timed out on the rank that failed first relays it just as late);
        else return."""
        self.raise_confirmed(at_once=True)
        self._read_until(time.monotonic() + RELAY_WAIT, None)

    def _read_until(self, end: float, cause: BaseException | None) -> None:
        while time.monotonic() < end:
            time.sleep(POLL)
            self.raise_confirmed(at_once=True, cause=cause)

    def _failed(self, records: list[tuple[int, str]], mine: set[int]) -> PeerFailed | None:
        """The error for standing records: the ranks that failed on their own, with their words;
        else the ranks that relays blame and that published nothing themselves (the first failure,
        not the neighbour that relayed it); None when the relays blame only this rank, or only
        ranks this rank's own error (blaming ``mine``) names first-hand."""
        me = self.view.rank
        parsed = {r: (tuple(int(c) for c in blamed.split(",") if c), text)
                  for r, record in records for blamed, text in [record.split("|", 1)]}  # fmt: skip
        own = [(r, text) for r, (blamed, text) in parsed.items() if not blamed]
        if own:
            texts = "; ".join(f"rank {r} failed: {text}" for r, text in own)
            error = blame(PeerFailed(f"rank {me}: {self._what()}: {texts}"), [r for r, _ in own])
            error.own_error = True
            return error
        roots = sorted({c for blamed, _ in parsed.values() for c in blamed if c not in parsed and c != me})
        if not roots or {*roots} <= mine:
            return None
        who = f"rank{'s' if len(roots) > 1 else ''} {', '.join(map(str, roots))}"
        seen = "; ".join(f"rank {r}: {text}" for r, (by, text) in parsed.items() if set(by) & {*roots})
        message = f"rank {me}: {self._what()}: {who} failed first (seen by {seen})"
        return blame(PeerFailed(message), roots)

    def _what(self) -> str:
        return self.what() if callable(self.what) else self.what


_hosted: dict[Hashable, RefitGroup] = {}
"""The groups whose store this process hosts and on whose board it published a failure."""


_threads_to_end: list[tuple[Callable[[], None], Callable[[float], None]]] = []
"""``(stop, join)`` of the threads that read the board (``watcher`` registers its own)."""


def end_at_exit(stop: Callable[[], None], join: Callable[[float], None]) -> None:
    """Have the exit sequence stop a thread that reads the board, and wait for it (once each)."""
    if (stop, join) not in _threads_to_end:
        _threads_to_end.append((stop, join))


@atexit.register
def at_exit() -> None:
    """The exit sequence: stay until peers learnt this rank's failures (store hosts), then end every
    thread that may be inside native code (the watcher's, the store calls')."""
    linger_at_exit()
    for stop, _ in _threads_to_end:
        stop()
    release_helpers()
    for _, join in _threads_to_end:
        join(STOP_WAIT)


def linger_at_exit(seconds: float = LINGER) -> None:
    """Keep this process (and the stores it hosts) until every peer of a group it published a failure
    on has learnt of it: each has a record of its own or is named by one (``seconds`` at most)."""
    deadline = time.monotonic() + seconds
    for key, view in list(_hosted.items()):
        if key not in _published:  # taken down by a later refit call: nobody is reading it
            continue
        while time.monotonic() < deadline and not _all_heard(view, deadline - time.monotonic()):
            time.sleep(POLL)
    _hosted.clear()


def _all_heard(view: RefitGroup, seconds: float) -> bool:
    """Whether every rank of ``view`` has a record on its board or is named by one (True when the
    board cannot be read: there is nothing to wait for)."""
    prefix = _prefix(view)

    def read(store: Any) -> bool:
        heard = set()
        for r in view.ranks:
            if store.check([prefix + str(r)]):
                blamed = store.get(prefix + str(r)).decode().split("|", 1)[0]
                heard |= {r, *(int(c) for c in blamed.split(",") if c)}
        return heard >= set(view.ranks)

    try:
        return call(view.store(), read, max(seconds, 0.0), view.store_host())
    except Exception:
        return True


def _prefix(view: RefitGroup) -> str:
    return f"reshard/failed/{','.join(map(str, view.ranks[:8]))}/{len(view.ranks)}/"
