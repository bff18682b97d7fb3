"""Hook module of reshard-nvshmem: declares the plugin API and reports whether the transport can run here."""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """None when the `nvshmem` transport can run on this machine, else why not."""
    from .transport import NvshmemCopyService

    return NvshmemCopyService.unavailable_reason()
