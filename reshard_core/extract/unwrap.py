"""What a wrapper is: the one place that says which module, and which name, is the real model's.

Two kinds of wrappers hide a model, and each has its own remedy:

- **Root wrappers** hold the model in ``.module`` and add nothing of its own: torch's DDP and FSDP1
  (``DistributedDataParallel``, ``FullyShardedDataParallel``), Megatron's DDP, its precision
  wrappers (``Float16Module``, ``FP8Module``, ``FP4Module``) and its FSDP wrappers
  (``FullyShardedDataParallel``, ``TorchFullyShardedDataParallel``). ``unwrap`` removes them, so
  format detection, format mapping, extraction and the Megatron compatibility layer all look at
  the same module. They are matched by class name, so neither torch's nor Megatron's classes are
  imported.
- **Path wrappers** insert an attribute into parameter qualnames wherever they wrap a submodule
  (FSDP1's ``_fsdp_wrapped_module``, activation checkpointing's ``_checkpoint_wrapped_module``,
  ``torch.compile``'s ``_orig_mod``). ``strip_wrappers`` drops those components from a name; they
  never name user modules, so dropping them anywhere is safe.
"""

from __future__ import annotations

from typing import Any

import torch

ROOT_WRAPPERS = frozenset(
    {
        "DistributedDataParallel",
        "Float16Module",
        "FP8Module",
        "FP4Module",
        "FullyShardedDataParallel",
        "TorchFullyShardedDataParallel",
    }
)
"""Class names of the wrappers whose ``.module`` is the model they wrap."""

PATH_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Qualname components that wrappers insert (``a._fsdp_wrapped_module.b`` is ``a.b``)."""


def unwrap(module: Any) -> Any:
    """``module`` with every root wrapper removed: follows ``.module`` while the class is a root
    wrapper and ``.module`` is a ``torch.nn.Module``; anything else is returned as it is."""
    while type(module).__name__ in ROOT_WRAPPERS and isinstance(
        getattr(module, "module", None), torch.nn.Module
    ):
        module = module.module
    return module


def unwrap_all(model: Any) -> list[Any]:
    """The unwrapped root modules of ``model``: a module, a list of pipeline chunks, or None (no
    modules). Items are not checked to be modules; callers that need modules check."""
    if model is None:
        return []
    return [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def strip_wrappers(qualname: str) -> str:
    """``qualname`` without path-wrapper components (``a._fsdp_wrapped_module.b`` -> ``a.b``)."""
    parts = qualname.split(".")
    if not PATH_WRAPPERS.intersection(parts):
        return qualname
    return ".".join(p for p in parts if p not in PATH_WRAPPERS)
