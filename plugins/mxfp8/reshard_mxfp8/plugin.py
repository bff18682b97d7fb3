"""Hook module of reshard-mxfp8: declares the plugin API; hook implementations join as they land."""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """The pure-PyTorch MXFP8 format works everywhere; TE and FlashInfer are optional accelerators."""
    return None
