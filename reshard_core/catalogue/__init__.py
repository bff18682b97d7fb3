"""Model shapes for offline planning: a built-in catalogue and JSON shape files.

``model_names()`` and ``CONFIGS`` import no torch (so ``reshard --help`` stays fast); the shape
builders and the JSON loader are imported on first use.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .configs import GPTConfig, LinearAttentionConfig, MLAConfig
from .models import CONFIGS

if TYPE_CHECKING:
    from .shapes import ModelShapes

_LAZY = {
    "gpt_shapes": "gpt",
    "KINDS": "shapes",
    "ModelShapes": "shapes",
    "ShapeEntry": "shapes",
    "ShapeFileError": "shapes",
    "dump_json": "shapes",
    "load_json": "shapes",
}

__all__ = ["CONFIGS", "GPTConfig", "LinearAttentionConfig", "MLAConfig", "get_model", "model_names", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


def model_names() -> list[str]:
    return sorted(CONFIGS)


@lru_cache(maxsize=8)
def _builtin(name: str) -> ModelShapes:
    from .gpt import gpt_shapes

    return gpt_shapes(CONFIGS[name])


def get_model(name_or_path: str) -> ModelShapes:
    """A catalogue model by name, or the shapes in a JSON file; ``ValueError`` if neither
    (``ShapeFileError``, naming the file, the entry and the key, for a file that is unusable)."""
    if name_or_path in CONFIGS:
        return _builtin(name_or_path)
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        from .shapes import load_json

        return load_json(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(model_names())} or a JSON file")
