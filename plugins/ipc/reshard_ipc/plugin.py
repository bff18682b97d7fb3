"""Hook module of reshard-ipc: declares the plugin API and reports whether the transport can run here."""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """None when the `ipc` transport can run on this machine, else why not."""
    from .transport import IpcCopyService

    return IpcCopyService.unavailable_reason()
