"""Landing a delta message: write only the changed 16-bit words into the destination.

The receiving half of a delta refit (``delta`` explains the protocol): the message's positions and
values (``delta_codec``) are applied to the destination's own words, read where they changed and
written back, so the work is proportional to the changed words. A message's slots may be plain
tensors, strided views or split regions; each is written in place.
"""

from __future__ import annotations

import torch

from ..errors import ReshardError
from ..views import copy_into, materialize
from . import delta_codec
from .messages import Incoming
from .slots import Slot


def land(incoming: Incoming) -> None:
    """Apply an encoded message: for each changed word, read the destination's old word and write
    the new one (work proportional to the changed words)."""
    recipe = incoming.recipe
    delta = delta_codec.decode(incoming.message)
    if delta_codec.payload_words(incoming.message) * 2 != recipe.nbytes:
        raise ReshardError(
            f"a delta from rank {incoming.peer} was encoded for a message of "
            f"{delta_codec.payload_words(incoming.message) * 2} bytes, this rank expects {recipe.nbytes}"
        )
    if recipe.direct is not None:
        _apply(recipe.direct.reshape(-1).view(torch.uint8).view(torch.int16), delta.positions, delta, 0, None)
        return
    bounds = torch.tensor([s.offset // 2 for _, s in recipe.pieces] + [recipe.nbytes // 2])
    cuts = torch.searchsorted(delta.positions.cpu(), bounds).tolist()
    for (target, slot), lo, hi in zip(recipe.pieces, cuts, cuts[1:], strict=False):
        if lo == hi:
            continue
        local = delta.positions[lo:hi] - slot.offset // 2
        local = local[local < slot.nbytes // 2]  # words of the padding after a slot carry nothing
        _write_words(target, slot, local, delta, lo)


def _apply(words: torch.Tensor, index: torch.Tensor, delta: delta_codec.Delta, lo: int, hi: int | None):
    words[index] = delta.values(words[index], lo, hi)


def _write_words(target, slot: Slot, local: torch.Tensor, delta: delta_codec.Delta, lo: int) -> None:
    """Apply ``delta``'s entries ``lo..`` (at word ``local`` of ``target``'s row-major words)."""
    hi = lo + local.numel()
    plain = isinstance(target, torch.Tensor)
    if plain and target.is_contiguous() and target.data_ptr() % 2 == 0:
        _apply(target.reshape(-1).view(torch.uint8).view(torch.int16), local, delta, lo, hi)
    elif plain and target.element_size() % 2 == 0:
        _apply(_storage_words(target), _strided_words(target, local), delta, lo, hi)
    else:  # a split region, or strided single bytes: through one contiguous copy of it
        region = materialize(target).contiguous().clone()
        _apply(region.reshape(-1).view(torch.uint8).view(torch.int16), local, delta, lo, hi)
        copy_into(target, region)


def _storage_words(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat int16 tensor."""
    storage = tensor.untyped_storage()
    words = torch.empty(0, dtype=torch.int16, device=tensor.device)
    return words.set_(storage, 0, (storage.nbytes() // 2,), (1,))


def _strided_words(tensor: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Storage word indices of the row-major words ``local`` of a strided ``tensor``."""
    per = tensor.element_size() // 2
    element, word = local // per, local % per
    offset = torch.full_like(element, tensor.storage_offset())
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        offset += (element % size) * stride
        element = element // size
    return offset * per + word
