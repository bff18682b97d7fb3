"""Hook module of reshard-gloo: declares the plugin API and reports whether the transport can run here."""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """None when the `gloo` transport can run on this machine, else why not."""
    from .transport import GlooCopyService

    return GlooCopyService.unavailable_reason()
