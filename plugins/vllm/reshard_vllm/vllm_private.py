"""The private vLLM APIs reshard-vllm relies on, in one place and checked against the vLLM release.

vLLM's weight-transfer and layerwise-reload modules expose no public way to re-process one layer, to
put a layer's kernel tensors back, to ask whether a backend is registered, or to reach the module a
``ModuleSource`` wraps. These helpers do, for the releases listed in ``TESTED``; on another release a
name that moved raises ``ReshardError`` naming it and the release, instead of an ``ImportError``
deep inside an update.
"""

from __future__ import annotations

import importlib
from typing import Any

from reshard_core import ReshardError

TESTED = ("0.32",)
"""vLLM releases (major.minor) whose private names below are known."""


def vllm_release() -> str:
    """The installed vLLM's version, or "unknown"."""
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def _private(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ReshardError(
            f"reshard-vllm: vLLM {vllm_release()} has no {module}.{name}, a private API it relies on "
            f"(known in vLLM {', '.join(TESTED)})"
        ) from exc


def layerwise_process(layer: Any, info: Any) -> None:
    """Re-process one layer inside a layerwise reload (vLLM's ``_layerwise_process``)."""
    _private("vllm.model_executor.model_loader.reload.layerwise", "_layerwise_process")(layer, info)


def place_kernel_tensors(layer: Any, info: Any) -> None:
    """Give a layer its kernel tensors back inside a layerwise reload (``_place_kernel_tensors``)."""
    _private("vllm.model_executor.model_loader.reload.layerwise", "_place_kernel_tensors")(layer, info)


def registered(factory: Any, backend: str) -> bool:
    """Whether a weight-transfer factory already knows ``backend`` (its ``_registry``)."""
    return backend in getattr(factory, "_registry", {})


def wrapped_module(source: Any) -> Any:
    """The module a vLLM ``ModuleSource`` wraps (its ``_module``), or ``source`` itself."""
    return getattr(source, "_module", source)
