"""``PlanOptions``: the caller's choices that shape a rank's plan.

Every rank of a refit must pass the same ones (``exchange.option_digests`` checks that before planning):
a plan is a pure function of the layout table, the rank and these options. ``RefitOptions``
extends them with the choices that shape the execution, so a refit's options reach the planner
whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .validate import Tied

Options = TypeVar("Options", bound="PlanOptions")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """``max_batch_bytes``: the staging budget per batch (None: one batch; see ``batching``).
    ``ignore`` (fnmatch patterns) and ``tied`` (``{dst_name: src_name}``, or True for Megatron's
    untied output layer) are the explicit opt-outs of ``validate_table``. ``cast``: accept
    dtype-only differences (the plan carries the destination dtype)."""

    max_batch_bytes: int | None = None
    ignore: Sequence[str] = ()
    tied: Tied = None
    cast: bool = False

    @classmethod
    def of(cls: type[Options], options: Options | None = None, **choices: Any) -> Options:
        """``options`` (all defaults when None) with ``choices`` replacing fields of the same name.
        ``TypeError`` names a choice that is no field."""
        base = cls() if options is None else options
        return replace(base, **choices) if choices else base
