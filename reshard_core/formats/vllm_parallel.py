"""How a vLLM engine's ranks are arranged (``VLLMParallel``), and where format "vllm" finds it.

A model carries its arrangement in the ``reshard_vllm_parallel`` attribute (set by ``declare_vllm``).
The core never reads a live vLLM: ``reshard-vllm`` declares a worker's model from vLLM's own process
groups (``reshard_vllm.layout.engine_parallel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError

PARALLEL_ATTR = "reshard_vllm_parallel"
"""The model attribute holding its ``VLLMParallel``."""

PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class VLLMParallel:
    """How a vLLM engine's ranks are arranged: ``tp_groups`` (global ranks, TP order) in DP order.

    One group is a plain TP engine; several are data-parallel replicas (dense weights replicated
    over them, MoE experts cut over all ``DP × TP`` ranks). ``enable_expert_parallel`` and
    ``expert_placement`` ("linear" or "round_robin") are vLLM's options of the same names.
    """

    tp_groups: tuple[tuple[int, ...], ...]
    enable_expert_parallel: bool = False
    expert_placement: str = "linear"

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(r) for r in g) for g in self.tp_groups)
        object.__setattr__(self, "tp_groups", groups)
        if not groups or not groups[0]:
            raise ValueError("VLLMParallel needs at least one non-empty TP group")
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"VLLMParallel: TP groups of different sizes {[len(g) for g in groups]}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"VLLMParallel: a rank appears twice in {groups}")
        if self.expert_placement not in PLACEMENTS:
            raise ValueError(f"VLLMParallel: expert_placement must be one of {PLACEMENTS}")

    @classmethod
    def of(
        cls,
        tp_ranks: Sequence[int],
        *,
        dp_replicas: Sequence[Sequence[int]] = (),
        enable_expert_parallel: bool = False,
        expert_placement: str = "linear",
    ) -> VLLMParallel:
        """One TP group (``tp_ranks``), then the TP groups of further DP replicas."""
        groups = (tuple(tp_ranks), *(tuple(g) for g in dp_replicas))
        return cls(groups, enable_expert_parallel, expert_placement)

    @property
    def tp_size(self) -> int:
        return len(self.tp_groups[0])

    @property
    def dp_size(self) -> int:
        return len(self.tp_groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, flattened ``dp_rank·T + tp_rank`` (vLLM's MoE order)."""
        return tuple(r for g in self.tp_groups for r in g)

    @property
    def use_ep(self) -> bool:
        """vLLM holds whole experts per rank only with expert parallelism over more than one rank."""
        return self.enable_expert_parallel and len(self.ranks) > 1

    def experts_of(self, num_experts: int) -> list[list[int]]:
        """The global experts each flattened rank holds, in local order (expert parallelism only)."""
        p = len(self.ranks)
        if self.expert_placement == "round_robin":
            return [list(range(r, num_experts, p)) for r in range(p)]
        b, q = divmod(num_experts, p)
        return [list(range(r * b + min(r, q), r * b + min(r, q) + b + (r < q))) for r in range(p)]


def parallel_of(model: Any) -> VLLMParallel:
    """``model``'s ``reshard_vllm_parallel`` (``FormatError`` when it has none)."""
    found = getattr(model, PARALLEL_ATTR, None)
    if isinstance(found, VLLMParallel):
        return found
    if found is not None:
        raise FormatError(f"format 'vllm': {PARALLEL_ATTR} is a {type(found).__name__}, not a VLLMParallel")
    raise FormatError(
        f"format 'vllm': the model has no {PARALLEL_ATTR} attribute; declare it with "
        "reshard_core.formats.declare_vllm(model, VLLMParallel(...)), or refit a vLLM engine through "
        "reshard-vllm, which reads it from vLLM's process groups"
    )
