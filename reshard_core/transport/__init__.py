"""Transports (CopyServices): the base contract, the point-to-point base and discovery by name.

The names in ``__all__`` are what a transport plugin builds on (``docs/plugins.md``). They are imported
on first use, so importing this package (as transport discovery does) imports neither torch nor a
backend.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "CopyService": "copy_service",
    "Round": "copy_service",
    "P2PCopyService": "p2p",
    "QueuedOp": "p2p",
    "Issued": "p2p",
    "InFlight": "p2p",
    "as_bytes": "p2p",
    "remaining": "p2p",
    "poll_until": "p2p",
    "message_task_id": "task_ids",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
