"""Lay a model's shapes out on a ``Parallel`` grid: the layout table of a simulated refit.

Each tensor gets one layout per side: a mesh over the ranks of its pipeline stage (and, for a
per-expert tensor, of its EP rank) with mesh dims ``(tensor-parallel, fsdp, replicas)``, size-1
dims dropped. See ``parallel`` for the rank order and ``catalogue.shapes`` for the kinds.
"""

from __future__ import annotations

from ..catalogue.shapes import ModelShapes, ShapeEntry
from ..layout import Layout, Mesh, Placement, Replicate, Shard
from ..plan.table import LayoutTable, TableBuilder
from ..specs import TensorMeta
from .parallel import Parallel

TP_PLACEMENT: dict[str, Placement] = {
    "replicated": Replicate(),
    "column": Shard(0),
    "vocab": Shard(0),
    "row": Shard(1),
    "strided": Shard(0, stride=2),
}


class GridLayouts:
    """Builds (and reuses) the layouts of one side."""

    def __init__(self, par: Parallel, model: ModelShapes, offset: int = 0) -> None:
        self.par, self.model, self.offset = par, model, offset
        experts = model.num_experts
        if experts and experts % par.ep:
            raise ValueError(f"{experts} experts do not split evenly over ep={par.ep}")
        if par.pp > max(model.num_layers, 1):
            raise ValueError(f"pp={par.pp} exceeds the model's {model.num_layers} layers")
        self.per_ep = experts // par.ep if experts else 0
        self._stage = {}
        self._cache: dict[tuple, Layout] = {}

    def layout(self, t: ShapeEntry) -> Layout:
        stage = self._stage.get(t.layer)
        if stage is None:
            stage = self._stage[t.layer] = self.par.stage_of_layer(t.layer, self.model.num_layers)
        tp = TP_PLACEMENT[t.kind] if t.shape else Replicate()
        if tp != Replicate() and tp.dim >= len(t.shape):
            raise ValueError(f"{t.name}: kind {t.kind!r} needs {tp.dim + 1} or more dims, shape is {t.shape}")
        fsdp = Shard(0) if t.shape and self.par.fsdp > 1 else Replicate()
        ep = None if t.expert is None else t.expert // self.per_ep
        key = (stage, tp, fsdp, ep)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._build(stage, tp, fsdp, ep)
        return found

    def _build(self, stage: int, tp: Placement, fsdp: Placement, ep: int | None) -> Layout:
        par = self.par
        if ep is None:  # dense: j = tp + TP·(cp + CP·(ep + EP·(fsdp + FSDP·dp)))
            tp_n, fsdp_n, rest_n = par.tp, par.fsdp, par.cp * par.ep * par.dp
            inner = par.tp * par.cp * par.ep

            def index(t: int, f: int, r: int) -> int:
                cp_ep, dp = r % (par.cp * par.ep), r // (par.cp * par.ep)
                return t + par.tp * cp_ep + inner * (f + par.fsdp * dp)
        else:  # experts: j = etp + ETP·(ep + EP·(fsdp + FSDP·edp))
            etp = par.expert_tp
            tp_n, fsdp_n, rest_n = etp, par.fsdp, par.stage_size // (etp * par.ep * par.fsdp)

            def index(t: int, f: int, r: int) -> int:
                return t + etp * (ep + par.ep * (f + par.fsdp * r))

        dims = [(tp_n, tp), (fsdp_n, fsdp), (rest_n, Replicate())]
        ranks = [
            par.rank(index(t, f, r), stage, self.offset)
            for t in range(tp_n)
            for f in range(fsdp_n)
            for r in range(rest_n)
        ]
        kept = [(n, p) for n, p in dims if n > 1] or [(1, Replicate())]
        return Layout(Mesh(tuple(ranks), tuple(n for n, _ in kept)), tuple(p for _, p in kept))


def build_table(model: ModelShapes, src: Parallel, dst: Parallel, dst_offset: int = 0) -> LayoutTable:
    """The layout table of refitting ``model`` from ``src`` (ranks ``0..``) to ``dst`` (ranks
    ``dst_offset..``; 0 = colocated)."""
    builder = TableBuilder()
    for side, grid in (("src", GridLayouts(src, model)), ("dst", GridLayouts(dst, model, dst_offset))):
        for t in model.tensors:
            layout = grid.layout(t)
            builder.add(side, layout.mesh.ranks[0], TensorMeta(t.name, t.shape, t.dtype), layout)
    return builder.build()
