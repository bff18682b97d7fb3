"""Model shapes for offline planning: a built-in catalogue and JSON shape files."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .gpt import GPTConfig, MLAConfig, gpt_shapes
from .models import CONFIGS
from .shapes import KINDS, ModelShapes, ShapeEntry, dump_json, load_json

__all__ = [
    "CONFIGS",
    "KINDS",
    "GPTConfig",
    "MLAConfig",
    "ModelShapes",
    "ShapeEntry",
    "dump_json",
    "get_model",
    "gpt_shapes",
    "load_json",
    "model_names",
]


def model_names() -> list[str]:
    return sorted(CONFIGS)


@lru_cache(maxsize=8)
def _builtin(name: str) -> ModelShapes:
    return gpt_shapes(CONFIGS[name])


def get_model(name_or_path: str) -> ModelShapes:
    """A catalogue model by name, or the shapes in a JSON file; ``ValueError`` if neither."""
    if name_or_path in CONFIGS:
        return _builtin(name_or_path)
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        return load_json(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(model_names())} or a JSON file")
