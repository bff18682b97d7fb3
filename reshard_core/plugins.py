"""The reshard plugin manager: built-in hook modules, entry-point plugins, and their status.

Contract:

- ``get_plugin_manager()`` returns one process-wide pluggy ``PluginManager("reshard")`` with the
  hookspecs of ``reshard_core.hookspecs``. It registers the built-in hook modules first, then every
  entry point of group ``reshard`` (in name order). pluggy calls later registrations first, so a
  plugin's ``firstresult`` hook runs before the built-in fallback.
- A plugin that fails to import, declares another plugin API than ``PLUGIN_API_VERSION``, or shares
  its name (or a transport name) with another distribution is recorded with its reason and not
  registered; everything else keeps working. ``RESHARD_STRICT_PLUGINS=1`` turns any such failure
  into a ``PluginError``. ``RESHARD_DISABLE_PLUGINS=a,b`` skips plugins (and transports) by name
  without importing them.
- Loading imports hook modules only (the built-in one and each plugin's, which must stay light:
  no torch at import). Whether a plugin can run here is asked only when the records are listed
  with ``check=True`` (``plugin_records()``'s default, ``reshard plugins list --check``, ``reshard
  doctor``): that loads each of its transports' entry points (one that fails to import or is not a
  ``CopyService`` subclass makes the record ``error``) and asks its optional
  ``unavailable_reason()``, then each transport's. A Gloo run never probes CUDA or NVSHMEM, and a
  listing without the check reports such records as ``unchecked`` without importing torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pluggy

from . import PLUGIN_API_VERSION, __version__, hookspecs
from .entry_points import (
    DISABLE_ENV,
    HOOK_GROUP,
    TRANSPORT_GROUP,
    EntryPointClaim,
    conflict_reason,
    disabled_names,
    entry_point_claims,
)
from .errors import PluginError
from .plugin_status import (
    UNCHECKED_REASON,
    PluginRecord,
    checked,
    error_text,
    hook_names,
    raise_if_strict,
    unknown_hooks,
)

BUILTIN_HOOK_MODULES = ("reshard_core.builtin_hooks",)


@dataclass
class _Entry:
    """A record plus what is left to check: its transports to load and its own probe.

    ``pending`` is False once checked, or when there was nothing to check (a failed or disabled record).
    """

    record: PluginRecord
    probe: Callable[[], object] | None = None
    pending: bool = False


class _State:
    """Everything the plugin manager built; replaced wholesale by ``reset_plugin_manager()``."""

    def __init__(self) -> None:
        self.pm: pluggy.PluginManager | None = None
        self.builtin: list[PluginRecord] = []
        self.entries: list[_Entry] = []
        self.in_process: dict[str, PluginRecord] = {}

    def build(self) -> None:
        pm = pluggy.PluginManager(HOOK_GROUP)
        pm.add_hookspecs(hookspecs)
        for module_name in BUILTIN_HOOK_MODULES:
            module = importlib.import_module(module_name)
            pm.register(module, name=module_name)
            self.builtin.append(
                PluginRecord(module_name, "reshard-core", __version__, hooks=hook_names(pm, module))
            )
        self.pm = pm
        self._load_entry_points()

    def _load_entry_points(self) -> None:
        hook_claims = entry_point_claims(HOOK_GROUP)
        transport_claims = entry_point_claims(TRANSPORT_GROUP)
        transports_of: dict[str, list[str]] = {}
        for tname, claims in transport_claims.items():
            for claim in claims:
                transports_of.setdefault(claim.distribution, []).append(tname)
        disabled = disabled_names()
        for name in sorted(hook_claims):
            claims = hook_claims[name]
            if len(claims) > 1:
                reason = conflict_reason("plugin", name, claims)
                for claim in claims:
                    transports = tuple(sorted(transports_of.get(claim.distribution, ())))
                    self._add(
                        PluginRecord(
                            name, claim.distribution, claim.version, transports, status="error", reason=reason
                        )
                    )
                continue
            self._load_one(
                name,
                claims[0],
                tuple(sorted(transports_of.get(claims[0].distribution, ()))),
                transport_claims,
                disabled,
            )
        self._add_transport_only(hook_claims, transport_claims, disabled)

    def _load_one(
        self,
        name: str,
        claim: EntryPointClaim,
        transports: tuple[str, ...],
        transport_claims: dict[str, list[EntryPointClaim]],
        disabled: frozenset[str],
    ) -> None:
        base = PluginRecord(name, claim.distribution, claim.version, transports)
        if name in disabled:
            self._add(dataclasses.replace(base, status="disabled", reason=f"disabled by {DISABLE_ENV}"))
            return
        for tname in transports:
            if len(transport_claims[tname]) > 1:
                reason = conflict_reason("transport", tname, transport_claims[tname])
                self._add(dataclasses.replace(base, status="error", reason=reason))
                return
        try:
            plugin = claim.entry_point.load()
        except Exception as exc:  # a broken plugin must not break the core
            self._add(dataclasses.replace(base, status="error", reason=error_text(exc)))
            return
        assert self.pm is not None
        base = dataclasses.replace(base, hooks=hook_names(self.pm, plugin))
        api = getattr(plugin, "RESHARD_PLUGIN_API", None)
        if api != PLUGIN_API_VERSION:
            declared = "does not declare RESHARD_PLUGIN_API" if api is None else f"targets plugin API {api!r}"
            reason = f"{declared}; this reshard-core provides plugin API {PLUGIN_API_VERSION}"
            self._add(dataclasses.replace(base, status="incompatible", reason=reason))
            return
        unknown = unknown_hooks(self.pm, plugin, base.hooks)
        if unknown:
            reason = f"implements unknown hook(s): {', '.join(unknown)}"
            self._add(dataclasses.replace(base, status="error", reason=reason))
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation: bad hook signature
            self._add(dataclasses.replace(base, status="error", reason=error_text(exc)))
            return
        probe = getattr(plugin, "unavailable_reason", None)
        self._add(base, probe if callable(probe) else None, pending=True)

    def _add_transport_only(
        self,
        hook_claims: dict[str, list[EntryPointClaim]],
        transport_claims: dict[str, list[EntryPointClaim]],
        disabled: frozenset[str],
    ) -> None:
        """Distributions that provide transports but no hook module get one record per transport."""
        with_hooks = {c.distribution for claims in hook_claims.values() for c in claims}
        for tname in sorted(transport_claims):
            claims = [c for c in transport_claims[tname] if c.distribution not in with_hooks]
            for claim in claims:
                base = PluginRecord(tname, claim.distribution, claim.version, (tname,))
                if len(transport_claims[tname]) > 1:
                    reason = conflict_reason("transport", tname, transport_claims[tname])
                    self._add(dataclasses.replace(base, status="error", reason=reason))
                elif tname in disabled:
                    reason = f"disabled by {DISABLE_ENV}"
                    self._add(dataclasses.replace(base, status="disabled", reason=reason))
                else:
                    self._add(base, pending=True)

    def _add(
        self, record: PluginRecord, probe: Callable[[], object] | None = None, pending: bool = False
    ) -> None:
        self.entries.append(_Entry(record, probe, pending))

    def check_all(self) -> None:
        """Check each loaded plugin once: load its transports, then ask whether it can run here."""
        disabled = disabled_names()
        for entry in self.entries:
            if entry.pending:
                entry.pending = False
                entry.record = checked(entry.record, entry.probe, disabled)

    def records(self, include_builtin: bool) -> list[PluginRecord]:
        out = [
            dataclasses.replace(e.record, status="unchecked", reason=UNCHECKED_REASON)
            if e.pending
            else e.record
            for e in self.entries
        ]
        out += list(self.in_process.values())
        if include_builtin:
            out += self.builtin
        return sorted(out, key=PluginRecord.sort_key)


_LOCK = threading.RLock()
_STATE = _State()


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use (see the module docstring).

    Raises ``PluginError`` in strict mode when any plugin failed to load.
    """
    with _LOCK:
        if _STATE.pm is None:
            _STATE.build()
        raise_if_strict(_STATE.records(include_builtin=False))
        assert _STATE.pm is not None
        return _STATE.pm


def plugin_records(*, include_builtin: bool = False, check: bool = True) -> list[PluginRecord]:
    """Every known plugin, sorted by (name, distribution), with its availability on this machine.

    ``include_builtin`` adds the core's own hook module. ``check`` loads every transport entry point
    and asks every probe (once per process; this usually imports torch); without it, records not
    checked yet are ``unchecked``. Raises ``PluginError`` in strict mode when any plugin failed to
    load, a transport failed to load, or a probe raised.
    """
    with _LOCK:
        get_plugin_manager()
        if check:
            _STATE.check_all()
        records = _STATE.records(include_builtin)
        raise_if_strict(records)
        return records


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register an object or module with ``@hookimpl`` functions in this process; returns its name.

    Like an entry-point plugin, it is called before the built-in hooks. ``name`` defaults to the
    object's ``__name__`` or its class name. If the object declares ``RESHARD_PLUGIN_API`` it must
    match. Raises ``PluginError`` for an API mismatch, no or unknown hooks, or a name in use.
    """
    pm = get_plugin_manager()
    plugin_name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    api = getattr(plugin, "RESHARD_PLUGIN_API", PLUGIN_API_VERSION)
    if api != PLUGIN_API_VERSION:
        raise PluginError(
            f"plugin '{plugin_name}' targets plugin API {api!r}; "
            f"this reshard-core provides plugin API {PLUGIN_API_VERSION}"
        )
    hooks = hook_names(pm, plugin)
    if not hooks:
        raise PluginError(
            f"plugin '{plugin_name}' implements no reshard hook (mark functions with @hookimpl)"
        )
    unknown = unknown_hooks(pm, plugin, hooks)
    if unknown:
        raise PluginError(f"plugin '{plugin_name}' implements unknown hook(s): {', '.join(unknown)}")
    with _LOCK:
        taken = {r.name for r in _STATE.records(include_builtin=True)}
        if plugin_name in taken or pm.has_plugin(plugin_name):
            raise PluginError(f"cannot register plugin '{plugin_name}': that name is already in use")
        try:
            pm.register(plugin, name=plugin_name)
        except Exception as exc:
            raise PluginError(f"cannot register plugin '{plugin_name}': {error_text(exc)}") from exc
        _STATE.in_process[plugin_name] = PluginRecord(plugin_name, None, None, hooks=hooks)
    return plugin_name


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with ``register_plugin``; ``PluginError`` if there is none by that name."""
    pm = get_plugin_manager()
    with _LOCK:
        if name not in _STATE.in_process:
            raise PluginError(f"no in-process plugin named '{name}' is registered")
        pm.unregister(name=name)
        del _STATE.in_process[name]


def reset_plugin_manager() -> None:
    """Forget the plugin manager and every record (tests; the next call rebuilds from entry points)."""
    global _STATE
    with _LOCK:
        _STATE = _State()
