"""Model shapes for offline planning: one ``ShapeEntry`` per logical tensor, and JSON loading.

A shape entry carries what the simulator needs to lay the tensor out like Megatron-Core would:

- ``kind``: how tensor parallelism splits it — ``replicated``, ``column`` (dim 0), ``row`` (dim 1),
  ``strided`` (dim 0, ``partition_stride=2``: gated ``linear_fc1``), ``vocab`` (dim 0 of the
  embedding / output layer);
- ``layer``: the global transformer layer, ``-1`` for tensors before the first layer (the
  embedding, on the first pipeline stage), ``num_layers`` for those after the last (final norm,
  output layer, on the last stage);
- ``expert``: the global expert index of a per-expert tensor (expert parallelism splits these),
  else None.

JSON form: ``{"name", "num_layers"?, "num_attention_heads"?, "num_query_groups"?, "tensors":
[{"name", "shape", "dtype"?, "kind"?, "layer"?, "expert"?}]}`` (or the bare ``tensors`` list).
Without ``num_layers`` the highest layer plus one is taken; omitted
``layer``/``expert`` are read from Megatron-style names (``decoder.layers.L.``,
``experts.local_experts.E.`` or grouped ``experts.linear_fc1.weightE``); ``dtype`` defaults to
``bfloat16`` and ``kind`` to ``replicated``. Every error names the file (and the entry and key).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

KINDS = ("replicated", "column", "row", "strided", "vocab")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(?:local_experts\.(\d+)\.|.*\.(?:weight|bias)(\d+)$)")


@dataclass(frozen=True)
class ShapeEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "replicated"
    layer: int = -1
    expert: int | None = None


@dataclass(frozen=True)
class ModelShapes:
    """A model's logical tensors; ``num_layers`` places pre/post tensors on pipeline stages."""

    name: str
    tensors: tuple[ShapeEntry, ...]
    num_layers: int
    heads: int | None = None
    """Attention heads (None: unknown), so a layout whose TP does not divide them can be refused."""
    kv_groups: int | None = None
    """Query groups (key/value heads), likewise."""

    @cached_property
    def num_experts(self) -> int:
        experts = [t.expert for t in self.tensors if t.expert is not None]
        return max(experts) + 1 if experts else 0

    @cached_property
    def nbytes(self) -> int:
        return sum(_numel(t.shape) * t.dtype.itemsize for t in self.tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def infer_layer(name: str, num_layers: int) -> int:
    """Global layer from a Megatron-style name; -1 before the layers (embeddings), else after."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1))
    return -1 if name.startswith("embedding") else num_layers


def infer_expert(name: str) -> int | None:
    m = _EXPERT.search(name)
    if not m:
        return None
    return int(m.group(1) if m.group(1) is not None else m.group(2))


def load_json(path: str | Path) -> ModelShapes:
    """Read a JSON shape file (see module docstring); ``ValueError`` naming the file, and the entry
    and key where one is bad or missing."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    try:
        return _shapes_from(data, path.stem)
    except _MissingKey as exc:
        raise ValueError(f"{path}: {exc.where} is missing key {exc.key!r}") from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


class _MissingKey(Exception):
    def __init__(self, where: str, key: str) -> None:
        super().__init__(where, key)
        self.where, self.key = where, key


def _get(entry: object, key: str, where: str):
    if not isinstance(entry, dict):
        raise TypeError(f"{where} must be a JSON object, got {type(entry).__name__}")
    if key not in entry:
        raise _MissingKey(where, key)
    return entry[key]


def _shapes_from(data: object, stem: str) -> ModelShapes:
    raw = _get(data, "tensors", "the top level") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise TypeError(f"'tensors' must be a list, got {type(raw).__name__}")
    top = data if isinstance(data, dict) else {}
    num_layers = top.get("num_layers")
    names = [_get(t, "name", f"tensors[{i}]") for i, t in enumerate(raw)]
    if num_layers is None:  # one past the highest layer named or given
        layers = [t["layer"] if "layer" in t else infer_layer(n, -1) for t, n in zip(raw, names, strict=True)]
        num_layers = 1 + max([-1, *layers])
    tensors = []
    for i, t in enumerate(raw):
        name = names[i]
        shape = _get(t, "shape", f"tensors[{i}] ({name})")
        kind = t.get("kind", "replicated")
        if kind not in KINDS:
            raise ValueError(f"{name}: kind {kind!r} is not one of {', '.join(KINDS)}")
        dtype = getattr(torch, str(t.get("dtype", "bfloat16")).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {t.get('dtype')!r}")
        layer = t["layer"] if "layer" in t else infer_layer(name, num_layers)
        expert = t["expert"] if "expert" in t else infer_expert(name)
        tensors.append(ShapeEntry(name, tuple(int(s) for s in shape), dtype, kind, layer, expert))
    return ModelShapes(
        top.get("name", stem),
        tuple(tensors),
        num_layers,
        top.get("num_attention_heads"),
        top.get("num_query_groups"),
    )


def dump_json(model: ModelShapes) -> str:
    """The JSON form of ``model`` (round-trips through ``load_json``)."""
    return json.dumps(
        {
            "name": model.name,
            "num_layers": model.num_layers,
            **({"num_attention_heads": model.heads} if model.heads is not None else {}),
            **({"num_query_groups": model.kv_groups} if model.kv_groups is not None else {}),
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "kind": t.kind,
                    "layer": t.layer,
                    **({"expert": t.expert} if t.expert is not None else {}),
                }
                for t in model.tensors
            ],
        },
        indent=1,
    )
