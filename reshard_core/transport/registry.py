"""Transport discovery: named drivers in entry-point group ``reshard.transports``.

Only the transport asked for is imported (stevedore ``DriverManager`` over that one entry point),
so a Gloo run never imports CUDA or NVSHMEM code. This module itself imports neither torch nor
stevedore until a transport is requested.
"""

from __future__ import annotations

import importlib.metadata as metadata
from typing import TYPE_CHECKING

from ..entry_points import (
    DISABLE_ENV,
    HOOK_GROUP,
    TRANSPORT_GROUP,
    EntryPointClaim,
    conflict_reason,
    disabled_names,
    entry_point_claims,
)
from ..errors import PluginError, one_line

if TYPE_CHECKING:
    from .copy_service import CopyService


def transport_names() -> list[str]:
    """Sorted names of every installed transport (nothing is imported)."""
    return sorted(entry_point_claims(TRANSPORT_GROUP))


def get_transport(name: str) -> type[CopyService]:
    """The ``CopyService`` subclass registered as transport ``name``; imports only that driver.

    Raises ``PluginError`` when the name is unknown (listing the known names), claimed by more than
    one distribution, disabled by ``RESHARD_DISABLE_PLUGINS`` (by its own name or its plugin's), when
    its module fails to import, or when the entry point is not a ``CopyService`` subclass.
    """
    claims = entry_point_claims(TRANSPORT_GROUP)
    if name not in claims:
        known = ", ".join(sorted(claims)) or "(none installed)"
        raise PluginError(f"unknown transport '{name}'; known transports: {known}")
    if len(claims[name]) > 1:
        raise PluginError(conflict_reason("transport", name, claims[name]))
    claim = claims[name][0]
    blocked = disabled_names() & ({name} | _plugin_names_of(claim.distribution))
    if blocked:
        raise PluginError(f"transport '{name}' is disabled by {DISABLE_ENV} ({', '.join(sorted(blocked))})")
    driver = _load(claim)

    from .copy_service import CopyService

    if not (isinstance(driver, type) and issubclass(driver, CopyService)):
        raise PluginError(
            f"transport '{name}' ({claim.label()}) points to {claim.entry_point.value}, "
            f"which is not a CopyService subclass"
        )
    return driver


def _plugin_names_of(distribution: str) -> set[str]:
    """Names of the ``reshard`` hook plugins that ``distribution`` provides."""
    return {
        ep.name
        for ep in metadata.entry_points(group=HOOK_GROUP)
        if ep.dist is not None and ep.dist.name == distribution
    }


def _load(claim: EntryPointClaim) -> object:
    from stevedore import DriverManager

    class _OneDriver(DriverManager):
        # Load exactly the entry point resolved above: stevedore's own entry-point cache is
        # process-wide per group and would miss plugins put on sys.path later.
        def list_entry_points(self) -> list[metadata.EntryPoint]:
            return [claim.entry_point]

    def failed(_manager: object, _ep: object, exc: BaseException) -> None:
        message = one_line(exc)
        raise PluginError(
            f"transport '{claim.entry_point.name}' ({claim.label()}) failed to load: "
            f"{type(exc).__name__}: {message}"
        ) from exc

    manager = _OneDriver(
        TRANSPORT_GROUP,
        claim.entry_point.name,
        invoke_on_load=False,
        on_load_failure_callback=failed,
        on_missing_entrypoints_callback=None,
    )
    return manager.driver


def transport_label(cls: type) -> str:
    """How errors name a transport class: ``transport 'gloo' (plugin reshard-gloo)`` for one an installed
    distribution registers, else its name and defining module (e.g. a ``CopyService`` passed in-process)."""
    target = f"{cls.__module__}:{cls.__qualname__}"
    name = getattr(cls, "name", "") or cls.__name__
    try:
        for claims in entry_point_claims(TRANSPORT_GROUP).values():
            for claim in claims:
                if claim.entry_point.value.replace(" ", "") == target:
                    return f"transport '{claim.entry_point.name}' (plugin {claim.distribution})"
    except Exception:  # naming must never hide the error being reported
        pass
    return f"transport '{name}' (not a plugin: {cls.__module__}.{cls.__qualname__})"
