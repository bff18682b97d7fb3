"""``share``: every member of a refit group publishes a few bytes and reads everyone's, through the
group's store, within a deadline. Transports use it to set themselves up (e.g. to tell which peers
share a host); it runs no collective on the process group, so it never pairs with a refit's rounds.

Every member must call it with the same ``key``, once. Keys stay in the store for the store's life:
pick one that is unique per use among the groups sharing the store (a transport instance's serial
number, say).
"""

from __future__ import annotations

import datetime
from typing import Any

from ..coordination.refit_group import RefitGroup
from ..coordination.store_calls import call
from ..errors import TransportError, first_line

DEFAULT_SECONDS = 300.0
"""How long ``share`` waits when the transport has no timeout."""


def share(view: RefitGroup, key: str, value: bytes, timeout: float | None) -> dict[int, bytes]:
    """Publish ``value`` under ``key`` for this rank; return every member's value by refit rank.

    Raises ``TransportError`` naming the ranks that did not publish within ``timeout`` seconds, or
    ``StoreSilent`` when the store's host stopped answering."""
    store = view.store()
    if store is None:
        raise TransportError(f"{key}: the group has no store to meet through")
    seconds = DEFAULT_SECONDS if timeout is None else timeout
    # A transfer group's store is its own; a process group's key is the same on every member.
    prefix = f"reshard/share/{'transfer' if view.transfer is not None else view.key}/{key}/"
    keys = {rank: prefix + str(rank) for rank in view.ranks}

    def meet(s: Any) -> dict[int, bytes]:
        s.set(keys[view.rank], value)
        try:
            s.wait(list(keys.values()), datetime.timedelta(seconds=seconds))
        except Exception as exc:
            absent = [rank for rank, k in keys.items() if not s.check([k])]
            if not absent:
                raise
            raise TransportError(
                f"{key}: ranks {absent} did not join within {seconds:g} s ({first_line(exc)})"
            ) from exc
        return {rank: bytes(s.get(k)) for rank, k in keys.items()}

    return call(store, meet, seconds + 2.0, view.store_host())
