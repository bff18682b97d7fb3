"""Finding a model's format: given by the caller, declared on the model, or detected.

Formats come from the ``reshard_formats`` hook (plugins first, the built-in ones last), so a
third-party format is found by name and detected before the built-ins.
"""

from __future__ import annotations

from typing import Any

from ..errors import PluginError
from ..extract import unwrap_all
from ..plugins import get_plugin_manager
from .base import ModelFormat

FORMAT_ATTR = "_reshard_format"


def available_formats() -> list[ModelFormat]:
    """Every registered format, in detection order (plugins first); names are unique."""
    return [fmt for fmt, _ in format_providers()]


def format_providers() -> list[tuple[ModelFormat, str]]:
    """``(format, plugin name)`` in detection order; the first format of a name wins.

    A plugin whose ``reshard_formats`` raises or returns something else than named formats is a
    ``PluginError`` naming the plugin.
    """
    found: dict[str, tuple[ModelFormat, str]] = {}
    for impl in reversed(get_plugin_manager().hook.reshard_formats.get_hookimpls()):
        try:
            result = impl.function()
        except Exception as exc:
            raise PluginError(f"plugin '{impl.plugin_name}': reshard_formats failed: {exc}") from exc
        for fmt in result or ():
            if not isinstance(fmt, ModelFormat) or not fmt.name:
                raise PluginError(
                    f"plugin '{impl.plugin_name}': reshard_formats returned {fmt!r}, "
                    "not a named reshard_core.ModelFormat"
                )
            found.setdefault(fmt.name, (fmt, impl.plugin_name))
    return list(found.values())


def format_named(name: str) -> ModelFormat:
    """The registered format called ``name``; ``PluginError`` listing the known ones otherwise."""
    formats = available_formats()
    for fmt in formats:
        if fmt.name == name:
            return fmt
    known = ", ".join(sorted(f.name for f in formats))
    raise PluginError(f"unknown model format {name!r}; known formats: {known}")


def declare_format(model: Any, fmt: ModelFormat | str) -> Any:
    """Declare that ``model`` (e.g. a custom engine's module) is in format ``fmt``; return it."""
    if not isinstance(fmt, ModelFormat):
        fmt = format_named(fmt)
    for module in unwrap_all(model):
        setattr(module, FORMAT_ATTR, fmt)
    return model


def resolve_format(model: Any, given: ModelFormat | str | None) -> ModelFormat | None:
    """The format of ``model``: ``given`` (an instance or a name), else one declared on the model,
    else the first registered format that detects it, else None (same-format refits need none)."""
    if isinstance(given, ModelFormat):
        return given
    if given is not None:
        return format_named(given)
    modules = unwrap_all(model)
    if not modules:
        return None
    declared = getattr(modules[0], FORMAT_ATTR, None)
    if declared is not None:
        return declared
    for fmt in available_formats():
        if fmt.detect(modules[0]):
            return fmt
    return None
