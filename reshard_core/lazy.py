"""Lazily imported package attributes: a package's public names load on first use, so importing the
package (``reshard --help``, transport discovery) imports neither torch nor a backend."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__``: ``exports`` maps each public name to
    the submodule (relative to ``package``) that defines it; a name is imported on first access and
    then kept in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        """The public names (lazily imported ones included) plus what is already loaded."""
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
