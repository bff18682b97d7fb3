"""Groups a refit gave up on: once a peer died or stalled during a refit, its group is not refit again.

A refit that fails because a peer (or the store's host) died or stalled abandons its waits on that
peer: a collective some ranks entered, a receive still posted. A later refit on the same group would
pair its calls with those stale ones, hang, or make Gloo abort the process. So ``mark`` records the
group on each rank whose refit raised such an error (``failures`` tells: a ``TransportError`` that
blames peers, or a silent store) and on each rank that gave up on a collective for any reason
(``bounded``, ``agree``: it stays pending and would pair with a later call); ``check`` makes the
next refit on that group raise at once, before any collective, saying what happened and how to go
on: a new process group, or a new ``TransferGroup``.

Other failures leave the group usable: errors every rank raised alike (the agreement round, a plan
every rank validates), errors on bad input (raised before data moves), and a transport that failed
on its own or because a peer raised its own error (``PeerFailed`` with that peer's words) while no
rank had to give up on a collective: a failed transport is closed, and the next refit builds a new
one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch.distributed as dist

from ..errors import TransportError, first_line
from .refit_group import RefitGroup

_broken: dict[Hashable, tuple[Any, str]] = {}
"""Group key -> (the process group object that broke, the first line of the error that broke it)."""


class BrokenGroup(TransportError):
    """A refit was asked of a group that an earlier refit on this rank left broken."""


def mark(view: RefitGroup, exc: BaseException) -> None:
    """Record ``view``'s group as broken by ``exc`` (the first error is kept)."""
    if view.key not in _broken or _broken[view.key][0] is not identity(view):
        _broken[view.key] = (identity(view), f"{type(exc).__name__}: {first_line(exc)}"[:300])


def check(view: RefitGroup) -> None:
    """Raise ``BrokenGroup`` when an earlier refit on this very group failed while data moved."""
    entry = _broken.get(view.key)
    if entry is None or entry[0] is not identity(view):
        return
    raise BrokenGroup(
        f"rank {view.rank}: this refit group is broken: an earlier refit on it failed while data "
        f"moved ({entry[1]}), and its ranks may still have calls pending that a new refit would pair "
        f"with; {_recovery(view)}"
    )


def identity(view: RefitGroup) -> Any:
    """The object whose identity says "the same group": a new one after re-initialising."""
    if view.transfer is not None:
        return view.transfer
    if view.pg is not None:
        return view.pg
    try:
        return dist.distributed_c10d._get_default_group()
    except Exception:  # torch.distributed was torn down meanwhile
        return None


def _recovery(view: RefitGroup) -> str:
    if view.transfer is not None:
        return "close the transfer group and join a new one"
    if view.pg is not None:
        return "refit over a new process group (dist.new_group)"
    return (
        "destroy the default process group and initialise a new one (dist.destroy_process_group, "
        "dist.init_process_group), or restart the job"
    )
