"""What is known about each plugin: its record and status, the strict-mode switch, and checking
whether a loaded plugin can run here (the entry points that claim a name are ``entry_points``).

``plugins`` builds the plugin manager from these; ``reshard plugins list`` and ``reshard doctor``
show the records.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pluggy

from .errors import PluginError, one_line

STRICT_ENV = "RESHARD_STRICT_PLUGINS"

Status = Literal["available", "unavailable", "unchecked", "error", "incompatible", "disabled"]
FAILED_STATUSES = frozenset({"error", "incompatible"})
UNCHECKED_REASON = "not probed; --check loads its transports and asks"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class PluginRecord:
    """What is known about one plugin.

    ``distribution``/``version`` are None for a plugin registered in-process. ``transports`` are
    the ``reshard.transports`` names of the same distribution; ``hooks`` the hook names it
    implements. ``reason`` explains any status other than ``available``; ``unchecked`` means it
    loaded but whether it can run here was not asked (a listing without the check).
    """

    name: str
    distribution: str | None
    version: str | None
    transports: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()
    status: Status = "available"
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (lists instead of tuples)."""
        out = dataclasses.asdict(self)
        out["transports"] = list(self.transports)
        out["hooks"] = list(self.hooks)
        return out

    def sort_key(self) -> tuple[str, str]:
        return (self.name, self.distribution or "")


def strict_mode() -> bool:
    """True when ``RESHARD_STRICT_PLUGINS`` asks for load failures to raise."""
    raw = os.environ.get(STRICT_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise PluginError(f"{STRICT_ENV} must be 0 or 1, got {os.environ[STRICT_ENV]!r}")


def hook_names(pm: pluggy.PluginManager, plugin: object) -> tuple[str, ...]:
    """Sorted names of the ``@hookimpl``-marked functions of ``plugin``."""
    return tuple(sorted(attr for attr in dir(plugin) if pm.parse_hookimpl_opts(plugin, attr) is not None))


def unknown_hooks(pm: pluggy.PluginManager, plugin: object, hooks: tuple[str, ...]) -> list[str]:
    """Hook names with no hookspec (a typo would otherwise never be called), unless marked optional."""
    unknown = []
    for hook in hooks:
        opts = pm.parse_hookimpl_opts(plugin, hook) or {}
        caller = getattr(pm.hook, hook, None)
        if (caller is None or not caller.has_spec()) and not opts.get("optionalhook"):
            unknown.append(hook)
    return unknown


def error_text(exc: BaseException) -> str:
    """An exception as one line: its type and its message with whitespace collapsed."""
    message = one_line(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def checked(
    record: PluginRecord, probe: Callable[[], object] | None, disabled: frozenset[str]
) -> PluginRecord:
    """``record`` after loading its transports and asking its probe, then each transport's."""
    from .transport.registry import get_transport

    drivers = []
    for tname in record.transports:
        if tname in disabled:
            continue
        try:
            drivers.append((tname, get_transport(tname)))
        except PluginError as exc:  # fails to import, or is not a CopyService subclass
            return dataclasses.replace(record, status="error", reason=str(exc))
    asked = [("unavailable_reason()", probe)] if probe is not None else []
    asked += [(f"transport '{t}': unavailable_reason()", d.unavailable_reason) for t, d in drivers]
    for what, ask in asked:
        try:
            reason = ask()
        except Exception as exc:
            return dataclasses.replace(record, status="error", reason=f"{what} raised {error_text(exc)}")
        if reason is not None:
            text = " ".join(str(reason).split()) or "no reason given"
            return dataclasses.replace(record, status="unavailable", reason=text)
    return record


def raise_if_strict(records: list[PluginRecord]) -> None:
    if not strict_mode():
        return
    for record in records:
        if record.status in FAILED_STATUSES:
            suffix = f"({STRICT_ENV}=1)"
            if record.reason and record.reason.startswith(f"transport '{record.name}' "):
                raise PluginError(f"{record.reason} {suffix}")  # already names the transport and its origin
            origin = f"{record.distribution} {record.version}" if record.distribution else "in-process"
            what = "is incompatible" if record.status == "incompatible" else "failed to load"
            raise PluginError(f"plugin '{record.name}' ({origin}) {what}: {record.reason} {suffix}")
