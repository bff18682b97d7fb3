"""The built-in per-tensor planner, registered as a hook implementation (the fallback).

``reshard_core.plugins`` registers this module as a built-in hook module; a plugin's
``reshard_plan_tensor`` that returns a result wins over this one (``trylast``).
"""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl(trylast=True)
def reshard_plan_tensor(entry, rank, context):
    """Plan ``entry`` for ``rank`` with the box planner (see ``reshard_core.plan.boxes``)."""
    from .boxes import plan_tensor

    return plan_tensor(entry, rank, context)
