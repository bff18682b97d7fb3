"""The process-wide caches behind ``refit`` and ``prepare``: prepared sessions and the transports
reshard made for them.

A session is cached under its models' identities and every option (``session_key``) and dropped as
soon as one of its models is garbage collected, when its transport fails, or when the group it was
built over is closed. Transports made from a name are shared by the sessions of one group and
timeout; one the caller passed in is never closed here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import fingerprints
from .coordination.refit_group import RefitGroup, view_of
from .errors import ReshardError
from .transport.copy_service import CopyService
from .transport.registry import get_transport

if TYPE_CHECKING:
    from .options import RefitOptions
    from .session import Session


@dataclass
class _Cached:
    """A prepared session and the finalizers that drop it when one of its models is collected."""

    session: Session
    finalizers: list[weakref.finalize]


_sessions: dict[tuple, _Cached] = {}
_transports: dict[tuple, CopyService] = {}
_GROUP = 3  # where a session key holds its group's key (``forget_group``)


def session_key(src: Any, dst: Any, options: RefitOptions) -> tuple:
    """The cache key of a session: the models' identities plus every option, hashable."""
    o = options
    fmt = [f if f is None or isinstance(f, str) else id(f) for f in (o.src_format, o.dst_format)]
    return (
        tuple(id(m) for m in fingerprints.modules(src)),
        tuple(id(m) for m in fingerprints.modules(dst)),
        o.transport if isinstance(o.transport, str) else id(o.transport),
        view_of(o.group).key,
        tuple(id(x) for x in o.transforms()),
        o.max_batch_bytes,
        tuple(o.ignore),
        tuple(sorted((o.tied or {}).items())),
        o.timeout,
        *fmt,
        bool(o.cast),
        bool(o.verify),
        bool(o.delta),
    )


def cached(key: tuple) -> Session | None:
    """The session cached under ``key``, if any (whether it still fits is the caller's to check)."""
    found = _sessions.get(key)
    return None if found is None else found.session


def remember(key: tuple, session: Session) -> None:
    """Cache ``session`` under ``key``; it is dropped as soon as one of the models it was built for
    is collected (or the transfer group it runs over closes)."""
    _drop(key)
    _follow_group(session.options.group)
    models = [m for m in (ref() for ref in session.seen.models) if m is not None]
    finalizers = [weakref.finalize(m, _sessions.pop, key, None) for m in models]
    _sessions[key] = _Cached(session, finalizers)


def check_transport(transport: str | CopyService) -> None:
    """``PluginError``/``ReshardError`` now when ``transport`` names no transport that can run here
    (before the agreement round, so every rank raises it alike); a ``CopyService`` passes."""
    if isinstance(transport, CopyService):
        return
    reason = get_transport(transport).unavailable_reason()
    if reason is not None:
        raise ReshardError(f"transport '{transport}' is unavailable here: {reason}")


def transport_for(transport: str | CopyService, group: Any, timeout: float | None) -> CopyService:
    """``transport`` itself when it is a ``CopyService``; else the cached (or a new) instance of
    the registered transport of that name for ``group`` and ``timeout``."""
    if isinstance(transport, CopyService):
        return transport
    view = _follow_group(group)
    key = (transport, view.key, timeout)
    service = _transports.get(key)
    if service is None:
        cls = get_transport(transport)
        reason = cls.unavailable_reason()
        if reason is not None:
            raise ReshardError(f"transport '{transport}' is unavailable here: {reason}")
        service = _transports[key] = cls(group, timeout=timeout)
    return service


def _follow_group(group: Any) -> RefitGroup:
    """``group``'s view; a transfer group is asked to tell the cache when it closes."""
    view = view_of(group)
    if view.transfer is not None:
        view.transfer.on_close(forget_group)
    return view


def forget_transport(service: CopyService) -> None:
    """Drop every cached session using ``service``; close it when it is one of ours, never one the
    caller passed in."""
    for key, entry in list(_sessions.items()):
        if entry.session.transport is service:
            _drop(key)
    _close_transports(lambda key, held: held is service)


def forget_group(key: Any) -> None:
    """Drop the sessions and close the transports built over the group whose ``RefitGroup.key`` is
    ``key`` (a ``TransferGroup`` being closed)."""
    for session_key_ in [k for k in _sessions if k[_GROUP] == key]:
        _drop(session_key_)
    _close_transports(lambda transport_key, held: transport_key[1] == key)


def clear() -> None:
    """Forget every cached session and close every cached transport."""
    for key in list(_sessions):
        _drop(key)
    services = list(_transports.values())
    _transports.clear()
    for service in services:
        service.close()


def _drop(key: tuple) -> None:
    entry = _sessions.pop(key, None)
    for finalizer in entry.finalizers if entry is not None else ():
        finalizer.detach()


def _close_transports(chosen) -> None:
    for key, service in list(_transports.items()):
        if chosen(key, service):
            del _transports[key]
            try:
                service.close()
            except Exception:  # best effort: the error that brought us here (or the closing group) matters
                pass
