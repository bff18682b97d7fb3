"""Build one rank's refit ``Session``: extract → agree that no rank failed → exchange → plan.

``api`` calls ``build`` once every rank agreed (``coordination.agree``) that no cached session fits.
Extraction goes through the models' formats when they differ (``preparation.sides``); any rank's problem
is raised on every rank before the exchange (``coordination.verdict``), and a plan error on every rank
before any data moves. Padding is zero-filled only once the plan is valid, so a refused refit
leaves the destination untouched.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..coordination import failures
from ..coordination.problems import Problems, raise_if_any
from ..coordination.refit_group import RefitGroup, to_refit_ranks, view_of
from ..errors import PlanError, ReshardError
from ..exchange import exchange_layouts
from ..execute.delta_state import DeltaState
from ..extract import ExtractContext, extract_specs
from ..extract.destinations import destination_problems
from ..extract.freshness import source_refreshers
from ..fingerprints import Model, ModelsSeen
from ..options import RefitOptions
from ..plan.cache import cached_plan_rank
from ..plugins import get_plugin_manager
from ..session import Session
from ..session_cache import forget_transport, transport_for
from ..specs import TensorSpec
from ..transform import ReshardTransform
from .sides import FormatChoice, logical_hint, logical_side


def build(
    src: Model, dst: Model, sides: tuple, options: RefitOptions, choice: FormatChoice, signature: tuple
) -> Session:
    """This rank's session, complete. ``sides``: the global ranks passing a source / destination
    model, over which each side's plain, undeclared tensors are replicated; ``signature``: the
    models' ``model_signature`` pair, recorded with what the session was built for. Collective over
    ``options.group``."""
    o = options
    view = view_of(o.group)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    problems = Problems()
    src_specs, dst_specs, padding = [], [], []
    try:
        syncs = source_refreshers(src)  # deferred param all-gathers: finished before other refreshers
        src_specs, _ = _describe(src, "src", view, sides[0], choice, o.ignore, problems)
        dst_specs, padding = _describe(dst, "dst", view, sides[1], choice, o.ignore, problems)
    except ReshardError as exc:
        problems.errors.append(str(exc))
    if not problems.errors and not problems.unmapped:  # else those name the cause more precisely
        problems.errors += destination_problems(dst_specs, view.rank, o.ignore)
    transforms: list[ReshardTransform] = []
    try:
        transforms = _transforms(dst, dst_specs, o)
    except Exception as exc:  # a plugin's hook: every rank learns it in the verdict below
        problems.errors.append(f"{type(exc).__name__}: {exc}")
    with failures.raised_alike():
        raise_if_any(problems, o.group, o.timeout)
    seconds["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    table, exchange_stats = exchange_layouts(src_specs, dst_specs, group=o.group, timeout=o.timeout)
    seconds["exchange"] = time.perf_counter() - t

    t = time.perf_counter()
    with failures.raised_alike():  # every rank validates the same table
        try:
            plan, _ = cached_plan_rank(table, view.rank, replace(o, tied=choice.ties(o.tied)), group=view.key)
        except PlanError as exc:
            hint = logical_hint(str(exc)) if choice.mapped else ""
            if not hint:
                raise
            raise PlanError(f"{exc}{hint}") from None
    seconds["plan"] = time.perf_counter() - t
    with torch.no_grad():  # once the plan is valid: a refused refit leaves the destination untouched
        for pad in padding:  # zero-filled once: no source element ever lands there
            pad.zero_()
    return Session(
        plan=plan,
        src_tensors={spec.meta.name: spec.tensor for spec in src_specs},
        dst_tensors={spec.meta.name: spec.tensor for spec in dst_specs},
        transport=transport_for(o.transport, o.group, o.timeout),
        transforms=transforms,
        metadata_bytes=exchange_stats.bytes,
        seconds=seconds,
        options=o,
        refreshers=[*syncs, *(spec.source for spec in src_specs if hasattr(spec.source, "refresh_source"))],
        delta=DeltaState() if o.delta else None,
        seen=ModelsSeen.of(src, dst, signature),
        on_failure=forget_transport,
    )


def _describe(
    model: Model,
    side: str,
    view: RefitGroup,
    ranks: tuple[int, ...],
    choice: FormatChoice,
    ignore,
    problems: Problems,
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """This rank's specs of one side (logical when ``choice.mapped``) in refit ranks, and its padding
    views. ``ranks``: the refit ranks holding this side. The model is read in its own job's ranks
    (a ``TransferGroup``'s jobs each have a world of their own), then shifted into refit ranks."""
    if model is None:
        return [], []
    group = None if view.transfer is not None else view.pg
    context = ExtractContext.create(group, replica_ranks=view.own_ranks(ranks))
    if not choice.mapped:
        specs, padding = extract_specs(model, side, group=group, context=context), []
    else:
        specs, padding = logical_side(model, side, choice.of(side), context, ignore, problems)
    return to_refit_ranks(specs, view.offset), padding


def _transforms(dst: Model, dst_specs: list[TensorSpec], options: RefitOptions) -> list[ReshardTransform]:
    """The caller's transforms plus those plugins attach for ``dst`` (``reshard_transforms`` hook)."""
    found = list(options.transforms())
    if dst is not None:
        found += [t for t in get_plugin_manager().hook.reshard_transforms(model=dst, specs=dst_specs) if t]
    return found
