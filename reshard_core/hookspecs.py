"""The pluggy hooks a reshard plugin may implement (project name ``reshard``, entry-point group ``reshard``).

A plugin is a module listed under the ``reshard`` entry-point group. It declares the plugin API it
targets with a module attribute ``RESHARD_PLUGIN_API = 1`` and may define ``unavailable_reason() ->
str | None`` to report a missing heavy dependency. Implementations are marked with ``@hookimpl``.
Hooks may gain arguments later; an implementation names only the arguments it uses (pluggy's rule),
so old plugins keep working.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("reshard")
hookimpl = pluggy.HookimplMarker("reshard")


@hookspec(firstresult=True)
def reshard_extract_tensor(qualname, tensor, owner, model, side, context):
    """Describe one parameter or persistent buffer of ``model`` as reshard specs.

    ``qualname`` is the tensor's dotted name in ``model``; ``owner`` the module that holds it
    directly; ``side`` is ``"src"`` or ``"dst"``; ``context`` an
    ``reshard_core.extract.context.ExtractContext`` (process group, rank, per-model caches).

    Return a list of ``TensorSpec`` (usually one; an empty list deliberately skips the tensor),
    or None to let the next extractor try. The most specific extractor wins: plugins are tried
    before the built-in DTensor, Megatron-attribute and plain-tensor extractors (the fallback).
    Canonical names must be layout independent (global layer and expert indices).
    """


@hookspec(firstresult=True)
def reshard_plan_tensor(entry, rank, context):
    """Plan one logical tensor for one rank: return its ordered ``TransferOp`` list, or None.

    ``entry`` is the tensor's ``reshard_core.plan.table.TableEntry`` (meta, source layouts,
    destination layouts); ``rank`` the planning rank; ``context`` a
    ``reshard_core.plan.planner_context.PlanContext`` (the whole table and its per-dimension indexes).
    The result must be a pure function of
    (entry, rank) so the peer of every send derives the matching receive in the same position.
    The built-in box planner is the fallback.
    """


@hookspec
def reshard_transforms(model, specs):
    """Return a ``ReshardTransform`` to attach for destination ``model`` (whose specs are given), or None.

    Every non-None result is attached; each transform claims tensors with ``should_transform(name)``
    and two transforms claiming one tensor is an error.
    """


@hookspec
def reshard_formats():
    """Return the ``reshard_core.ModelFormat`` instances this plugin provides (a list).

    A format maps a model's physical parameters onto logical (HF checkpoint) tensors, so refits
    cross naming, fusing and padding conventions. ``refit`` detects a model's format by asking
    each format's ``detect(model)`` in order: plugins first, the built-in formats last.
    """


@hookspec
def reshard_register_commands(app):
    """Add commands to the ``reshard`` CLI; ``app`` is the root ``typer.Typer``."""
