"""The core's own hook implementations, registered by the plugin manager before any plugin.

Each hook is ``trylast`` (any plugin's answer wins) and imports its real work inside the call:
registering this module imports neither torch nor the extract/plan/formats packages, so CLI
commands that only list things (``reshard --help``, ``reshard plugins list``) stay fast.
"""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl(trylast=True)
def reshard_extract_tensor(qualname, tensor, owner, model, side, context):
    """Specs from the first built-in extractor that claims ``tensor`` (see ``extract.builtin``), or None."""
    from .extract.builtin import reshard_extract_tensor as extract_builtin

    return extract_builtin(
        qualname=qualname, tensor=tensor, owner=owner, model=model, side=side, context=context
    )


@hookimpl(trylast=True)
def reshard_plan_tensor(entry, rank, context):
    """Plan ``entry`` for ``rank`` with the box planner (see ``reshard_core.plan.boxes``)."""
    from .plan.boxes import plan_tensor

    return plan_tensor(entry, rank, context)


@hookimpl(trylast=True)
def reshard_formats():
    """The built-in formats (see ``formats.builtin``), asked after every plugin's."""
    from .formats.builtin import builtin_formats

    return builtin_formats()
