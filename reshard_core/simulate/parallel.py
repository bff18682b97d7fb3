"""Parallel layout descriptions (``tp=8,pp=4,ep=8,etp=1,dp=2``, ``fsdp=64``) and their rank grids.

Rank order (Megatron's, TP fastest): ``rank = offset + tp + TP·(cp + CP·(ep + EP·(pp + PP·(fsdp +
FSDP·dp))))``. ``fsdp`` is data parallelism that shards parameters (FSDP2 ``Shard(0)`` of each
tensor's TP-local part); ``dp`` replicates. ``etp`` (expert tensor parallel) defaults to ``tp``.

Within one pipeline stage a rank's local index is ``j = tp + TP·(cp + CP·(ep + EP·(fsdp +
FSDP·dp)))``. Dense tensors split over ``tp`` then ``fsdp`` and replicate over ``cp × ep × dp``.
Experts view the same index as ``j = etp + ETP·(ep + EP·(fsdp + FSDP·edp))`` (Megatron's expert
grid): each EP rank holds ``experts / EP`` consecutive experts, split over ``etp`` then ``fsdp``,
replicated over ``edp``. With ``etp == tp`` and ``cp == 1`` that is the dense ``ep`` coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

KEYS = ("tp", "cp", "ep", "etp", "pp", "dp", "fsdp")


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    pp: int = 1
    dp: int = 1
    fsdp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.ep * self.pp * self.dp * self.fsdp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.world // self.pp

    def __str__(self) -> str:
        def shown(key: str) -> bool:  # defaults hidden; etp=1 under tp>1 is not a default
            value = getattr(self, key)
            return value not in (1, None) or (key == "etp" and value is not None and value != self.tp)

        return ",".join(f"{k}={getattr(self, k)}" for k in KEYS if shown(k)) or "tp=1"

    def rank(self, j: int, stage: int, offset: int = 0) -> int:
        """Global rank of stage-local index ``j`` on pipeline ``stage``."""
        inner = self.tp * self.cp * self.ep
        return offset + j % inner + inner * (stage + self.pp * (j // inner))

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """Balanced split of layers over stages; ``-1`` → first stage, ``num_layers`` → last."""
        if layer < 0:
            return 0
        if layer >= num_layers:
            return self.pp - 1
        return max(s for s in range(self.pp) if s * num_layers // self.pp <= layer)


def parse_parallel(text: str) -> Parallel:
    """Parse ``"tp=8,pp=4,ep=8,etp=1,dp=2"``; ``ValueError`` with a one-line reason."""
    values: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            raise ValueError(f"bad layout {text!r}: {item!r} is not one of {'/'.join(KEYS)}=N")
        if key in values:
            raise ValueError(f"bad layout {text!r}: {key} given twice")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"bad layout {text!r}: {key}={value.strip()!r} is not a whole number") from None
        if n < 1:
            raise ValueError(f"bad layout {text!r}: {key} must be >= 1")
        values[key] = n
    if not values:
        raise ValueError(f"bad layout {text!r}: expected e.g. tp=8,pp=2 or fsdp=64")
    par = Parallel(**values)
    if (par.tp * par.cp * par.dp) % par.expert_tp:
        raise ValueError(f"bad layout {text!r}: etp={par.expert_tp} must divide tp·cp·dp")
    return par
