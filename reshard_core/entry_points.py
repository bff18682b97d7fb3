"""Entry points: the two groups reshard reads, which distributions claim a name in them, and the
switch that disables plugins by name. The lowest layer of plugin loading: ``transport.registry``
and ``plugins`` (through ``plugin_status``) build on it, and it imports neither.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
from dataclasses import dataclass

HOOK_GROUP = "reshard"
"""Entry points of hook plugins (pluggy modules)."""
TRANSPORT_GROUP = "reshard.transports"
"""Entry points of transports (``CopyService`` subclasses), loaded by name (stevedore)."""
DISABLE_ENV = "RESHARD_DISABLE_PLUGINS"


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


def disabled_names() -> frozenset[str]:
    """Plugin and transport names listed in ``RESHARD_DISABLE_PLUGINS`` (comma separated)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())
