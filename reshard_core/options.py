"""``RefitOptions``: every choice of a refit but the models, as one frozen object.

``refit`` and ``prepare`` take one (or build one from their keywords) and pass it down whole: the
session cache keys on it, the agreement round checks that every rank passed the same plan- and
execution-shaping options (``exchange.option_digests``), and the planner reads its ``PlanOptions`` part.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .plan.plan_options import PlanOptions

if TYPE_CHECKING:
    import torch.distributed as dist

    from .formats import ModelFormat
    from .transform import ReshardTransform
    from .transport.copy_service import CopyService


TRANSPORT_ENV = "RESHARD_TRANSPORT"


def default_transport() -> str:
    """The transport a refit uses when none is named: ``$RESHARD_TRANSPORT``, else ``"gloo"``."""
    return os.environ.get(TRANSPORT_ENV) or "gloo"


@dataclass(frozen=True, kw_only=True)
class RefitOptions(PlanOptions):
    """The plan-shaping ``PlanOptions`` (``max_batch_bytes``, ``ignore``, ``tied``, ``cast``) plus:

    - ``transport``: a registered transport name or a ``CopyService`` instance (default: the
      ``RESHARD_TRANSPORT`` environment variable where set, else ``"gloo"``);
    - ``group``: the process group (or ``TransferGroup``) the refit is collective over (None: the world);
    - ``transform``: one ``ReshardTransform`` or several, besides those plugins attach;
    - ``timeout``: seconds after which a vanished peer makes every rank raise (None: the transport's);
    - ``src_format`` / ``dst_format``: a ``ModelFormat`` or a registered name, overriding detection;
    - ``verify``: check every arrival by checksum (``execute.verify``);
    - ``delta``: move only what changed since the last confirmed refit (``execute.delta``).

    ``ignore``, ``tied``, ``max_batch_bytes``, ``transport``, ``cast``, ``verify`` and ``delta`` must
    be the same on every rank.
    """

    transport: str | CopyService = field(default_factory=lambda: default_transport())
    group: dist.ProcessGroup | None = None
    transform: ReshardTransform | Sequence[ReshardTransform] | None = None
    timeout: float | None = None
    src_format: ModelFormat | str | None = None
    dst_format: ModelFormat | str | None = None
    verify: bool = False
    delta: bool = False

    def transforms(self) -> tuple[ReshardTransform, ...]:
        """``transform`` as a tuple (empty when None)."""
        from .transform import ReshardTransform

        t = self.transform
        return (t,) if isinstance(t, ReshardTransform) else tuple(t or ())
