"""Who a refit runs over: its ranks, this process's rank, and the process group to talk on.

A refit's ``group`` is None (the default world), a process group of the default world, or a
``TransferGroup`` joining separate jobs. ``view_of(group)`` turns each into one ``RefitGroup``, the
only place the refit path (agreement, exchange, planning, transports) learns ranks from. Ranks are
"refit ranks": global ranks of the default world for the first two, the group's own ranks for a
``TransferGroup``, whose jobs' layouts are shifted into them by ``to_refit_ranks``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from ..layout import Layout, Mesh
from ..specs import TensorSpec
from .store_calls import StoreHost, host_of
from .transfer_group import TransferGroup


@dataclass(frozen=True)
class RefitGroup:
    """``pg``: the process group collectives and point-to-point ops run on (None: the default world);
    ``ranks``: the refit ranks of its members in ``pg``'s rank order; ``rank``: this process's refit
    rank; ``world``: refit ranks lie in ``[0, world)``; ``offset``: added to a rank of this process's
    own job to give its refit rank (0 unless joined through a ``TransferGroup``); ``key``: hashable,
    equal for the same group; ``transfer``: the ``TransferGroup``, if any."""

    pg: Any
    ranks: tuple[int, ...]
    rank: int
    world: int
    backend: str
    offset: int
    key: Hashable
    transfer: TransferGroup | None = None

    def own_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """Of the refit ranks ``ranks``, those of this process's own job, in its own world's ranks."""
        if self.transfer is None:
            return tuple(ranks)
        job = self.transfer.job_ranks
        return tuple(r - self.offset for r in ranks if r in job)

    def store(self) -> Any:
        """A store every member reaches (to name ranks that never joined), or None."""
        if self.transfer is not None:
            return self.transfer.store
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:
            return None

    def store_host(self) -> StoreHost:
        """Who hosts ``store()``, and how to go on once it stopped answering."""
        return host_of(self.transfer)


def view_of(group: Any) -> RefitGroup:
    """The ``RefitGroup`` of a refit's ``group`` argument."""
    if isinstance(group, TransferGroup):
        if group.closed:
            from ..errors import TransportError

            raise TransportError(f"{group!r} is closed; join a new transfer group")
        ranks = tuple(range(group.size))
        return RefitGroup(
            group.pg, ranks, group.rank, group.size, group.backend, group.offset, group.key, group
        )
    if not (dist.is_available() and dist.is_initialized()):
        from ..errors import TransportError

        raise TransportError(
            "refit needs torch.distributed initialised (dist.init_process_group) or a TransferGroup as group="
        )
    world = dist.get_world_size()
    backend = str(dist.get_backend(group))
    if group is None:
        return RefitGroup(None, tuple(range(world)), dist.get_rank(), world, backend, 0, (-1, world))
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    return RefitGroup(group, ranks, dist.get_rank(), world, backend, 0, ranks)


def to_refit_ranks(specs: list[TensorSpec], offset: int) -> list[TensorSpec]:
    """``specs`` with every layout's mesh ranks shifted by ``offset`` (a job's ranks into a transfer
    group's). Layouts shared by several specs stay shared (the exchange interns them by identity)."""
    if not offset:
        return specs
    shifted: dict[int, Layout] = {}

    def shift(layout: Layout) -> Layout:
        if id(layout) not in shifted:
            mesh = Mesh(tuple(r + offset for r in layout.mesh.ranks), layout.mesh.shape)
            shifted[id(layout)] = Layout(mesh, layout.placements)
        return shifted[id(layout)]

    return [replace(spec, layout=shift(spec.layout)) for spec in specs]
