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

JSON form: ``{"name"?, "num_layers"?, "num_attention_heads"?, "num_query_groups"?, "tensors":
[{"name", "shape", "dtype"?, "kind"?, "layer"?, "expert"?}]}`` (or the bare ``tensors`` list).
Without ``num_layers`` the highest layer plus one is taken; omitted
``layer``/``expert`` are read from Megatron-style names (``decoder.layers.L.``,
``experts.local_experts.E.`` or grouped ``experts.linear_fc1.weightE``); ``dtype`` defaults to
``bfloat16`` and ``kind`` to ``replicated``. ``TOP_KEYS`` and ``entry_keys`` say what each key must
be (no other key is accepted); each tensor name appears once. Every error names the file, and the
entry and key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


class ShapeFileError(ValueError):
    """A JSON shape file that cannot be read or used; the message names the file, and the entry and
    key at fault."""


Check = Callable[[object], "str | None"]
"""A key's validator: what is wrong with a value (the text after ``key 'K': ``), or None if nothing."""

_SPLIT_DIM = {"column": 0, "strided": 0, "vocab": 0, "row": 1}
"""The dimension each ``kind`` splits over tensor parallelism."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true/false load as ints


def _show(value: object) -> str:
    """``value`` written as JSON, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _must(what: str, ok: Callable[[object], bool]) -> Check:
    return lambda value: None if ok(value) else f"{_show(value)} is not {what}"


def _dtype(name: object) -> torch.dtype | None:
    found = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) else None


def _shape(value: object) -> str | None:
    if not isinstance(value, list):
        return f"{_show(value)} is not a list of dimensions"
    for d, n in enumerate(value):
        if not _is_int(n) or n < 0:
            return f"dimension {d} is {_show(n)}, not a non-negative integer"
    return None


_NAME = _must("a non-empty string", lambda v: isinstance(v, str) and v != "")
_POSITIVE = _must("a positive integer", lambda v: _is_int(v) and v > 0)

TOP_KEYS: dict[str, Check] = {
    "name": _NAME,
    "num_layers": _must("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "num_attention_heads": _POSITIVE,
    "num_query_groups": _POSITIVE,
    "tensors": _must("a non-empty list of tensor entries", lambda v: isinstance(v, list) and len(v) > 0),
}
"""The keys a shape file's top-level object accepts, and what each must be."""


def entry_keys(num_layers: int | None) -> dict[str, Check]:
    """The keys a tensor entry accepts, and what each must be (``layer`` at most ``num_layers``
    when the file states it)."""
    layers = "an integer >= -1" if num_layers is None else f"an integer from -1 to {num_layers}"
    highest = float("inf") if num_layers is None else num_layers
    return {
        "name": _NAME,
        "shape": _shape,
        "dtype": _must("a torch dtype name such as bfloat16", lambda v: _dtype(v) is not None),
        "kind": _must(f"one of {', '.join(KINDS)}", lambda v: isinstance(v, str) and v in KINDS),
        "layer": _must(layers, lambda v: _is_int(v) and -1 <= v <= highest),
        "expert": _must("a non-negative integer or null", lambda v: v is None or (_is_int(v) and v >= 0)),
    }


def _checked(obj: object, keys: dict[str, Check], where: str, required: tuple[str, ...]) -> dict:
    """``obj``, once it is a dict holding ``required`` and only ``keys``, each passing its check;
    else ``ValueError`` naming ``where`` and the key."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is {_show(obj)}, not a JSON object")
    for key in required:
        if key not in obj:
            raise ValueError(f"{where} is missing key {key!r}")
    for key, value in obj.items():
        if key not in keys:
            raise ValueError(f"{where}: key {key!r} is not one of {', '.join(map(repr, keys))}")
        problem = keys[key](value)
        if problem is not None:
            raise ValueError(f"{where}: key {key!r}: {problem}")
    return obj


def load_json(path: str | Path) -> ModelShapes:
    """Read a JSON shape file (see module docstring); ``ShapeFileError`` naming the file, and the
    entry and key, for anything unreadable, missing, unknown, mistyped, out of range or repeated."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ShapeFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ShapeFileError(f"{path}: not valid JSON ({exc})") from None
    try:
        return _shapes_from(data, path.stem)
    except ValueError as exc:
        raise ShapeFileError(f"{path}: {exc}") from None


def _shapes_from(data: object, stem: str) -> ModelShapes:
    """The shapes in a loaded JSON document; ``ValueError`` naming the entry and key at fault."""
    if isinstance(data, list):
        data = {"tensors": data}
    top = _checked(data, TOP_KEYS, "the top level", required=("tensors",))
    entries: list[dict] = top["tensors"]
    keys = entry_keys(top.get("num_layers"))
    first_index: dict[str, int] = {}
    for i, t in enumerate(entries):
        name = t.get("name") if isinstance(t, dict) else None
        where = f"tensors[{i}] ({name})" if isinstance(name, str) and name else f"tensors[{i}]"
        _checked(t, keys, where, required=("name", "shape"))
        first = first_index.setdefault(name, i)
        if first != i:  # a repeated entry would count its bytes twice
            raise ValueError(f"{where}: key 'name': {name!r} is also tensors[{first}]")
        split, shape = _SPLIT_DIM.get(t.get("kind", "replicated")), t["shape"]
        if split is not None and 0 < len(shape) <= split:
            raise ValueError(
                f"{where}: key 'kind': {t['kind']!r} splits dimension {split}, not in shape {_show(shape)}"
            )
    num_layers = top.get("num_layers")
    if num_layers is None:  # one past the highest layer named or given
        num_layers = 1 + max(-1, *(t.get("layer", infer_layer(t["name"], -1)) for t in entries))
    tensors = []
    for i, t in enumerate(entries):
        name = t["name"]
        layer = t["layer"] if "layer" in t else infer_layer(name, num_layers)
        if layer > num_layers:
            raise ValueError(
                f"tensors[{i}] ({name}): key 'name': names layer {layer}, past num_layers {num_layers}"
            )
        expert = t["expert"] if "expert" in t else infer_expert(name)
        dtype = _dtype(t.get("dtype", "bfloat16")) or torch.bfloat16  # never None: checked
        tensors.append(ShapeEntry(name, tuple(t["shape"]), dtype, t.get("kind", "replicated"), layer, expert))
    heads, groups = top.get("num_attention_heads"), top.get("num_query_groups")
    return ModelShapes(top.get("name", stem), tuple(tensors), num_layers, heads, groups)


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
