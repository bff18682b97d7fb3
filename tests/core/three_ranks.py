"""The models of the 3-rank failure tests: rank 0 holds the (8, 4) source, ranks 1 and 2 hold 4-row
halves of the destination (``test_one_rank_failures``, ``test_refit_failures``,
``test_dead_or_stalled_rank``)."""

from __future__ import annotations

import torch
from torch import nn

SOURCE = torch.arange(32.0).reshape(8, 4)


def models(rank: int) -> tuple[nn.Module | None, nn.Module | None]:
    """``(source, destination)`` of ``rank``, the other one None."""
    from reshard_core import declare_layout

    src = dst = None
    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(SOURCE.clone())
        declare_layout(src.w, ranks=(0,))
    else:
        dst = nn.Module()
        dst.w = nn.Parameter(torch.zeros(4, 4))
        declare_layout(dst.w, dim=0, ranks=(1, 2))
    return src, dst
