"""Collectives bounded by the caller's ``timeout``: a peer that never joins fails its peers in time.

Without a bound, a rank that failed on its own, exited or stalled before a pre-execution collective
leaves every peer waiting until the process-group timeout (30 minutes by default). ``wait`` waits
for an ``async_op`` collective at most ``timeout`` seconds and then raises ``TransportError``
(on Gloo in short steps on the calling thread, which a short step's timeout leaves running, so a
collective that ends within the first step costs no thread handoff); a
peer that failed with an error of its own and published it (``failures``) ends the wait at once,
with that error. To name the ranks that never joined, a rank still waiting after the first tick
marks itself in the group's store (the default store, or a ``TransferGroup``'s) under a per-group
sequence number; at the deadline the unmarked ranks are the ones that never came (a stalled rank
never marks itself). Waits that finish within the first tick never touch the store.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from ..errors import TransportError, first_line
from ..plan.describe import format_ranks
from . import broken, failures
from .refit_group import RefitGroup, view_of
from .store_calls import StoreSilent, call

_sequence: dict[object, int] = {}
_GRACE = 0.25  # seconds for marks of ranks that joined just before the deadline to land


def wait(work: Any, timeout: float | None, group: Any, what: str) -> None:
    """Wait for ``work`` (a collective over ``group``, started with ``async_op=True``); raise
    ``TransportError`` naming ``what`` and, when it can be told, the ranks that did not join, or
    ``PeerFailed`` with a peer's own error."""
    view = view_of(group)
    ranks = view.ranks
    seq = _sequence[view.key] = _sequence.get(view.key, 0) + 1
    prefix = f"reshard/joined/{','.join(map(str, ranks[:8]))}/{len(ranks)}/{seq}/"

    def block() -> None:
        work.wait() if timeout is None else work.wait(datetime.timedelta(seconds=timeout))

    def step(seconds: float) -> bool:
        try:
            work.wait(datetime.timedelta(seconds=max(seconds, 0.001)))
            return True
        except Exception:
            if not work.is_completed():  # a short step's timeout leaves the collective running
                return False
        work.wait()  # it ended (maybe just after the step timed out): its own outcome
        return True

    try:
        _wait(view, block, step, what, timeout, prefix)
    except TransportError as exc:  # abandoned: the collective may still pair with a later call
        broken.mark(view, exc)
        raise


def _wait(view: RefitGroup, block, step, what: str, timeout: float | None, prefix: str) -> None:
    """``wait``'s body (``prefix``: where this wait's marks go in the store)."""
    ranks = view.ranks
    on_slow = lambda: _mark(view, prefix)  # noqa: E731
    try:
        if view.backend != "gloo":  # a timed-out wait may abort another backend's communicator
            failures.wait_for(block, view, what, timeout, on_slow=on_slow)
        elif not failures.wait_in_steps(step, view, what, timeout, on_slow=on_slow):
            raise TimeoutError(f"timed out after {timeout:g} s")
    except TransportError:  # a peer's own error, or the store's host stopped answering
        raise
    except Exception as exc:
        within = f" within {timeout:g} s" if timeout is not None else ""
        try:
            missing = _missing(view, prefix, timeout) if timeout is not None else None
        except StoreSilent as silent:
            raise TransportError(f"rank {view.rank}: {what}: {silent}") from exc
        who = (
            f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} of {format_ranks(ranks)} "
            f"did not join{within}"
            if missing
            else f"ranks {format_ranks(ranks)} did not all join{within}"
        )
        reason = first_line(exc)
        error = TransportError(f"rank {view.rank}: {what}: {who} (failed, exited or stalled): {reason}")
        raise failures.blame(error, missing or ()) from exc


def _mark(view: RefitGroup, prefix: str) -> None:
    try:
        call(view.store(), lambda store: store.set(prefix + str(view.rank), b"1"), failures.GRACE,
             view.store_host())  # fmt: skip
    except Exception:  # no store (or it does not answer): the error says only that someone is missing
        pass


def _missing(view: RefitGroup, prefix: str, timeout: float) -> list[int] | None:
    """The ranks that did not mark themselves (within a short grace), or None without a store;
    ``StoreSilent`` when the store does not answer."""
    ranks = view.ranks
    grace = min(timeout, _GRACE)

    def unmarked(store: Any) -> list[int]:
        store.set(prefix + str(view.rank), b"1")
        deadline = time.monotonic() + grace
        while True:
            missing = [r for r in ranks if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.02)

    try:
        return call(view.store(), unmarked, grace + failures.GRACE, view.store_host())
    except StoreSilent:
        raise
    except Exception:  # no default store (or it failed): say only that someone is missing
        return None
