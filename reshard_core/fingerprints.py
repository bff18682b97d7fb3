"""What a prepared session depends on locally, and how to tell that it changed.

A session fits its models while they are the very same objects (held by weak reference, so a new
model that reuses a dead one's ``id`` never matches), hold the same submodules, and every tensor
keeps its name, shape, dtype, stride, storage pointer and declared layout: its ``fingerprint``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ReshardError
from .extract import iter_tensors

Model = Any  # an nn.Module, a list of modules (virtual pipeline chunks), or None
Watched = tuple[weakref.ref, str, str, tuple]  # (owner module, "_parameters"/"_buffers", key, fingerprint)

PLAN_ATTRS = (
    "_reshard_layout", "_reshard_name", "_reshard_shape",  # declare_layout
    "tensor_model_parallel", "partition_dim", "partition_stride", "partition_sizes", "allreduce",  # Megatron
)  # fmt: skip
"""Tensor attributes the extractors read (besides a DTensor's placements): a change to any of them
changes the plan. They live in the tensor's ``__dict__``."""


def modules(model: Model) -> list[Any]:
    """The objects a model argument consists of (the modules of a list of chunks)."""
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def check_models(src: Model, dst: Model) -> None:
    """``ReshardError`` unless each model is a module, a list of modules (pipeline chunks) or None."""
    for word, model in (("source", src), ("destination", dst)):
        for m in modules(model):
            if not isinstance(m, torch.nn.Module):
                raise ReshardError(
                    f"the {word} model must be a torch.nn.Module, a list of them (pipeline chunks) or "
                    f"None, not {type(m).__name__}"
                )


def model_signature(model: Model, word: str) -> tuple:
    """Every tensor's name and ``fingerprint``. ``ReshardError`` for a lazy module's uninitialized
    tensor (``word`` names the side)."""
    out = []
    for root in modules(model):
        for name, t, _ in iter_tensors(root):
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
                raise ReshardError(
                    f"the {word} model's tensor {name} is uninitialized (a lazy module's parameter): run "
                    "a forward (or initialize it) before refitting"
                )
            out.append((name, fingerprint(t)))
    return tuple(out)


def fingerprint(tensor: torch.Tensor) -> tuple:
    """A tensor's shape, dtype, stride, storage pointer and everything else the plan depends on: a
    DTensor's placements and ``PLAN_ATTRS`` (``declare_layout`` layout/name/shape, Megatron's
    partition attributes)."""
    local = getattr(tensor, "_local_tensor", tensor)
    placements = tensor.placements if local is not tensor else None
    held = tensor.__dict__
    attrs = tuple([(a, _frozen(held[a])) for a in PLAN_ATTRS if a in held]) if held else ()
    return (tensor.shape, tensor.dtype, local.stride(), local.data_ptr(), placements, attrs)


def _frozen(value: object) -> object:
    """``value`` as a fingerprint holds it: itself when it cannot change in place (None, numbers,
    strings, tuples, frozen layouts and placements; compared with ``==``), else a ``repr`` snapshot
    (a list of partition sizes). Cheaper than ``repr`` for all: ``Session.refit`` checks every
    tensor before every execution."""
    if value is None or isinstance(value, (bool, int, float, str, tuple, torch.Size)):
        return value
    params = getattr(type(value), "__dataclass_params__", None)
    return value if params is not None and params.frozen else repr(value)


def watch(model: Model) -> list[Watched]:
    """Where each tensor of ``model`` sits (its owner, ``_parameters`` or ``_buffers``, the key), with
    its ``fingerprint``: enough to re-check it without walking the module tree again."""
    out = []
    for root in modules(model):
        for name, tensor, owner in iter_tensors(root):
            key = name.rsplit(".", 1)[-1]
            kind = "_parameters" if owner._parameters.get(key) is tensor else "_buffers"
            out.append((weakref.ref(owner), kind, key, fingerprint(tensor)))
    return out


def children(module: torch.nn.Module) -> tuple[int, ...]:
    """The ``id`` of each of a module's children (of None for an empty slot), in order.

    Ids suffice because ``ModelsSeen.structure`` lists every module of the tree with a weak
    reference of its own: a child can only be replaced by a new object with the same id once the
    old child was collected, and then the old child's own entry is found dead."""
    return tuple(map(id, module._modules.values()))


@dataclass(frozen=True)
class ModelsSeen:
    """What a session was prepared for, taken once when it is built: the source then destination
    modules (weakly held) and the destination modules alone, their ``model_signature`` pair, each
    tensor's place and fingerprint (``watch``), and each module's children."""

    models: tuple[weakref.ref, ...]
    destinations: tuple[weakref.ref, ...]
    signature: tuple
    watched: tuple[Watched, ...]
    structure: tuple[tuple[weakref.ref, tuple[int, ...]], ...]

    @classmethod
    def of(cls, src: Model, dst: Model, signature: tuple) -> ModelsSeen:
        found = modules(src) + modules(dst)
        return cls(
            models=tuple(weakref.ref(m) for m in found),
            destinations=tuple(weakref.ref(m) for m in modules(dst)),
            signature=signature,
            watched=tuple(watch(found)),
            structure=tuple((weakref.ref(m), children(m)) for root in found for m in root.modules()),
        )

    def same_objects(self, src: Model, dst: Model, signature: tuple) -> bool:
        """Whether ``src``/``dst`` are the very objects seen, with the same ``signature``."""
        found = modules(src) + modules(dst)
        if len(found) != len(self.models) or signature != self.signature:
            return False
        return all(ref() is m for ref, m in zip(self.models, found, strict=True))

    def change(self) -> str | None:
        """Why the models no longer match what was seen, or None when they still do."""
        if any(ref() is None for ref in self.models):
            return "a model it was prepared for was garbage collected"
        for ref, held in self.structure:
            module = ref()
            if module is None or children(module) != held:
                return "a submodule was replaced, added or removed"
        for owner, kind, key, print_ in self.watched:
            tensor = getattr(owner(), kind, {}).get(key)
            if tensor is None or fingerprint(tensor) != print_:
                return "a tensor was replaced, reshaped, moved or re-laid out"
        return None
