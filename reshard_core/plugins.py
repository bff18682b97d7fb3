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
import importlib.metadata as metadata
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import pluggy

from . import PLUGIN_API_VERSION, __version__, hookspecs
from .errors import PluginError

HOOK_GROUP = "reshard"
TRANSPORT_GROUP = "reshard.transports"
BUILTIN_HOOK_MODULES = ("reshard_core.builtin_hooks",)
STRICT_ENV = "RESHARD_STRICT_PLUGINS"
DISABLE_ENV = "RESHARD_DISABLE_PLUGINS"

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


@dataclass(frozen=True)
class EntryPointClaim:
    """One distribution's entry point for a name in a group."""

    entry_point: metadata.EntryPoint
    distribution: str
    version: str

    def label(self) -> str:
        return f"{self.distribution} {self.version}"


def entry_point_claims(group: str) -> dict[str, list[EntryPointClaim]]:
    """Entry points of ``group`` by name, each name with the distributions that claim it.

    Read fresh from ``importlib.metadata`` (so a change of ``sys.path`` is seen). A name with more
    than one claim is claimed by several distributions, which is an error for whoever uses it.
    """
    claims: dict[str, dict[str, EntryPointClaim]] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        dist_name = dist.name if dist is not None else "(unknown distribution)"
        version = dist.version if dist is not None else "?"
        claims.setdefault(ep.name, {}).setdefault(dist_name, EntryPointClaim(ep, dist_name, version))
    return {name: sorted(by_dist.values(), key=EntryPointClaim.label) for name, by_dist in claims.items()}


def conflict_reason(kind: str, name: str, claims: list[EntryPointClaim]) -> str:
    """The one-line reason for a name claimed by several distributions."""
    who = ", ".join(c.label() for c in claims)
    return f"{kind} name '{name}' is claimed by more than one distribution: {who}; uninstall all but one"


def strict_mode() -> bool:
    """True when ``RESHARD_STRICT_PLUGINS`` asks for load failures to raise."""
    raw = os.environ.get(STRICT_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise PluginError(f"{STRICT_ENV} must be 0 or 1, got {os.environ[STRICT_ENV]!r}")


def disabled_names() -> frozenset[str]:
    """Plugin and transport names listed in ``RESHARD_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def import_if_present(module: str) -> ModuleType | None:
    """Import ``module``; None if that module (or a parent package of it) does not exist.

    An import error raised from inside an existing module is a real error and propagates.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise


def hook_names(pm: pluggy.PluginManager, plugin: object) -> tuple[str, ...]:
    """Sorted names of the ``@hookimpl``-marked functions of ``plugin``."""
    return tuple(sorted(attr for attr in dir(plugin) if pm.parse_hookimpl_opts(plugin, attr) is not None))


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object, hooks: tuple[str, ...]) -> list[str]:
    """Hook names with no hookspec (a typo would otherwise never be called), unless marked optional."""
    unknown = []
    for hook in hooks:
        opts = pm.parse_hookimpl_opts(plugin, hook) or {}
        caller = getattr(pm.hook, hook, None)
        if (caller is None or not caller.has_spec()) and not opts.get("optionalhook"):
            unknown.append(hook)
    return unknown


def _error_text(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


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
            module = import_if_present(module_name)
            if module is None:
                continue  # that part of the core is not built yet
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
                    self._add(PluginRecord(name, claim.distribution, claim.version, transports,
                                           status="error", reason=reason))
                continue
            self._load_one(name, claims[0], tuple(sorted(transports_of.get(claims[0].distribution, ()))),
                           transport_claims, disabled)
        self._add_transport_only(hook_claims, transport_claims, disabled)

    def _load_one(self, name: str, claim: EntryPointClaim, transports: tuple[str, ...],
                  transport_claims: dict[str, list[EntryPointClaim]], disabled: frozenset[str]) -> None:
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
            self._add(dataclasses.replace(base, status="error", reason=_error_text(exc)))
            return
        assert self.pm is not None
        base = dataclasses.replace(base, hooks=hook_names(self.pm, plugin))
        api = getattr(plugin, "RESHARD_PLUGIN_API", None)
        if api != PLUGIN_API_VERSION:
            declared = "does not declare RESHARD_PLUGIN_API" if api is None else f"targets plugin API {api!r}"
            reason = f"{declared}; this reshard-core provides plugin API {PLUGIN_API_VERSION}"
            self._add(dataclasses.replace(base, status="incompatible", reason=reason))
            return
        unknown = _unknown_hooks(self.pm, plugin, base.hooks)
        if unknown:
            reason = f"implements unknown hook(s): {', '.join(unknown)}"
            self._add(dataclasses.replace(base, status="error", reason=reason))
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation: bad hook signature
            self._add(dataclasses.replace(base, status="error", reason=_error_text(exc)))
            return
        probe = getattr(plugin, "unavailable_reason", None)
        self._add(base, probe if callable(probe) else None, pending=True)

    def _add_transport_only(self, hook_claims: dict[str, list[EntryPointClaim]],
                            transport_claims: dict[str, list[EntryPointClaim]],
                            disabled: frozenset[str]) -> None:
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

    def _add(self, record: PluginRecord, probe: Callable[[], object] | None = None,
             pending: bool = False) -> None:
        self.entries.append(_Entry(record, probe, pending))

    def check_all(self) -> None:
        """Check each loaded plugin once: load its transports, then ask whether it can run here."""
        disabled = disabled_names()
        for entry in self.entries:
            if entry.pending:
                entry.pending = False
                entry.record = _checked(entry.record, entry.probe, disabled)

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


def _checked(record: PluginRecord, probe: Callable[[], object] | None,
             disabled: frozenset[str]) -> PluginRecord:
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
            return dataclasses.replace(record, status="error", reason=f"{what} raised {_error_text(exc)}")
        if reason is not None:
            text = " ".join(str(reason).split()) or "no reason given"
            return dataclasses.replace(record, status="unavailable", reason=text)
    return record


_LOCK = threading.RLock()
_STATE = _State()


def _raise_if_strict(records: list[PluginRecord]) -> None:
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


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use (see the module docstring).

    Raises ``PluginError`` in strict mode when any plugin failed to load.
    """
    with _LOCK:
        if _STATE.pm is None:
            _STATE.build()
        _raise_if_strict(_STATE.records(include_builtin=False))
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
        _raise_if_strict(records)
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
    unknown = _unknown_hooks(pm, plugin, hooks)
    if unknown:
        raise PluginError(f"plugin '{plugin_name}' implements unknown hook(s): {', '.join(unknown)}")
    with _LOCK:
        taken = {r.name for r in _STATE.records(include_builtin=True)}
        if plugin_name in taken or pm.has_plugin(plugin_name):
            raise PluginError(f"cannot register plugin '{plugin_name}': that name is already in use")
        try:
            pm.register(plugin, name=plugin_name)
        except Exception as exc:
            raise PluginError(f"cannot register plugin '{plugin_name}': {_error_text(exc)}") from exc
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
