"""Weight versions on destinations: which refit the weights a destination holds came from.

``refit(..., version=v)`` records ``v`` on this rank's destination modules once every destination
tensor of this rank has landed; ``weight_version(model)`` reads it. While a refit runs, and after
one that failed, a destination that carried a version carries None: its weights are then partly of
the new version and partly of the old one, and no version describes them. A version is this rank's
word about its own shard; an engine that spans ranks must expose a version only once every rank
recorded it (the ``reshard-vllm`` engine does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

VERSION_ATTR = "_reshard_weight_version"


def weight_version(model: Any) -> Any | None:
    """The version of the weights ``model`` holds on this rank (a module or a list of pipeline
    chunks): the ``version=`` of the last refit that wrote all of them; None before one, during
    one, after one that failed, or after one given no version."""
    modules = _roots(model)
    versions = {getattr(m, VERSION_ATTR, None) for m in modules}
    return versions.pop() if len(versions) == 1 else None


def begin(modules: Iterable[torch.nn.Module]) -> None:
    """A refit starts writing ``modules``: they no longer hold any one version."""
    for m in modules:
        if getattr(m, VERSION_ATTR, None) is not None:
            setattr(m, VERSION_ATTR, None)


def commit(modules: Iterable[torch.nn.Module], version: Any | None) -> None:
    """Every destination tensor of ``modules`` on this rank landed: they hold ``version``."""
    if version is None:
        return
    for m in modules:
        setattr(m, VERSION_ATTR, version)


def _roots(model: Any) -> list[Any]:
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]
