"""Hook module of reshard-nccl: declares the plugin API and reports whether the transport can run here."""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """None when the `nccl` transport can run on this machine, else why not."""
    from .transport import NcclCopyService

    return NcclCopyService.unavailable_reason()
