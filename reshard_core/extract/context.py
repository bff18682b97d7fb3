"""What every extractor needs to know besides the tensor: the process group, this rank, caches.

One ``ExtractContext`` lives for one ``extract_specs`` call. Caches are keyed by the extractor that
fills them (e.g. ``("megatron", id(model))``) so per-model work (module maps, layer-number maps,
group rosters) is done once per model, not once per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ReshardError


class ExtractError(ReshardError):
    """A model cannot be described: an unclaimed tensor, an unsupported placement, a bad declaration."""


@dataclass
class ExtractContext:
    """Process-group facts and caches shared by the extractors during one extraction.

    ``group`` is the group the caller collects over (None: the default world). ``rank`` and
    ``world`` are this process's global rank and the world size (0 and 1 without an initialised
    process group). ``replica_grid`` lets the Megatron extractor fold data-parallel replicas into
    one 2-d mesh (see ``megatron.py``); turn it off to get one layout per TP group.
    ``replica_ranks`` (global ranks) overrides where plain, undeclared tensors are replicated, e.g.
    only the ranks that hold this side's model in a non-colocated refit.
    """

    group: Any = None
    rank: int = 0
    world: int = 1
    replica_grid: bool = True
    caches: dict[Any, Any] = field(default_factory=dict)
    replica_ranks: tuple[int, ...] | None = None

    @classmethod
    def create(
        cls, group: Any = None, *, replica_grid: bool = True, replica_ranks: tuple[int, ...] | None = None
    ) -> ExtractContext:
        """A context for the current process (global rank and world from ``torch.distributed``)."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        elif group is not None:
            raise ExtractError("a process group was given but torch.distributed is not initialised")
        else:
            rank, world = 0, 1
        ranks = tuple(int(r) for r in replica_ranks) if replica_ranks is not None else None
        return cls(group, rank, world, replica_grid, replica_ranks=ranks)

    def cached(self, key: Any, factory: Callable[[], Any]) -> Any:
        """``caches[key]``, computed by ``factory()`` on first use."""
        if key not in self.caches:
            self.caches[key] = factory()
        return self.caches[key]

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        """Global ranks of ``group`` in group-rank order (cached per group object)."""
        return self.cached(("ranks", id(group)), lambda: _ranks_of(group, self))

    def default_ranks(self) -> tuple[int, ...]:
        """The ranks a plain, undeclared tensor is replicated over: ``replica_ranks`` when set, else
        ``group``, else the world."""
        if self.replica_ranks is not None:
            return self.replica_ranks
        if self.group is None:
            return tuple(range(self.world))
        return self.group_ranks(self.group)

    def modules(self, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """``dict(model.named_modules())`` (cached per model)."""
        return self.cached(("modules", id(model)), lambda: dict(model.named_modules()))


def _ranks_of(group: Any, ctx: ExtractContext) -> tuple[int, ...]:
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(ctx.world))
    if not (dist.is_available() and dist.is_initialized()):
        raise ExtractError("a process group was found but torch.distributed is not initialised")
    return tuple(int(r) for r in dist.get_process_group_ranks(group))
