"""Optional dependencies: one clear error when a function needs a package that is not installed.

Modules that need an optional package at import time raise ``MissingDependency`` themselves (in a
``try`` around the import); functions that import one lazily call ``require`` first.
"""

from __future__ import annotations

import importlib.util

from .errors import MissingDependency

MEGATRON_INSTALL = "pip install megatron-core einops"


def require(package: str, *, needed_by: str, install: str) -> None:
    """Raise ``MissingDependency`` naming ``needed_by`` unless ``package`` is installed (found, not
    imported: importing it may be slow or patch torch)."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a broken installation
        found = False
    if not found:
        raise MissingDependency(needed_by, package.split(".")[0], install)


def require_megatron(needed_by: str) -> None:
    """``require`` for Megatron-Core (distribution ``megatron-core``, import ``megatron.core``)."""
    try:
        require("megatron.core", needed_by=needed_by, install=MEGATRON_INSTALL)
    except MissingDependency:
        raise MissingDependency(needed_by, "megatron-core", MEGATRON_INSTALL) from None
