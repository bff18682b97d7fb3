"""Whether a refit goes through the logical space, and each side's logical specs when it does.

Every rank resolves the formats of the models it holds; one all-gather (``coordination.agree``) shares
them as ``format_code``s, and ``agreed_formats`` turns those into the same ``FormatChoice`` on
every rank: map both sides onto logical tensors exactly when each side has one format and the two
differ. Models of one format, or without one, are refit by their own tensor names as before.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..coordination.problems import Problems
from ..errors import ReshardError
from ..extract import ExtractContext
from ..formats.base import CanonicalFormat, ModelFormat
from ..formats.registry import available_formats
from ..plan.describe import format_ranks
from ..specs import TensorSpec
from .coverage import coverage_problems

LOGICAL_TIES = {"lm_head.weight": "model.embed_tokens.weight"}
"""A destination ``lm_head`` with no source ``lm_head`` is fed from the embedding: a logical source
without ``lm_head`` ties them (HF checkpoints leave ``lm_head`` out when tied)."""


_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def logical_hint(message: str) -> str:
    """What to add to a plan error of a refit across formats ("" when nothing applies): logical
    vocab tensors whose sizes differ are most often a padded vocab whose format was not told the
    real size; shared experts under one family's names but not the other's are a Megatron gate
    setting that does not match the HF family."""
    if message.startswith(tuple(f"{n}: source" for n in _VOCAB)) and " but destination " in message:
        return (
            "; if one side pads its vocab (Megatron pads it to a multiple of "
            "make_vocab_size_divisible_by·TP), give its format the real size, e.g. "
            "src_format=MegatronFormat(vocab_size=V) "
            "(from reshard_core.formats.megatron)"
        )
    if ".mlp.shared_experts." in message and ".mlp.shared_expert." in message:
        return (
            "; Megatron names gated shared experts (moe_shared_expert_gate=True) like Qwen2-MoE "
            "(mlp.shared_expert.*, mlp.shared_expert_gate.weight) and ungated ones like DeepSeek-V3 "
            "(mlp.shared_experts.*): the two models' shared experts differ"
        )
    return ""


def format_code(fmt: ModelFormat | None) -> int:
    """A small non-zero int standing for a format's name (0: no format), for the agreement round."""
    return 0 if fmt is None else (zlib.crc32(fmt.name.encode()) & 0x3FFFFFFF) or 1


@dataclass(frozen=True)
class FormatChoice:
    """How this refit extracts its two sides; identical on every rank."""

    mapped: bool
    src: ModelFormat | None = None
    dst: ModelFormat | None = None

    def of(self, side: str) -> ModelFormat:
        fmt = self.src if side == "src" else self.dst
        return fmt if fmt is not None else CanonicalFormat()

    def ties(self, given: Mapping[str, str] | bool | None) -> Mapping[str, str] | bool | None:
        """The ``tied`` option for planning: the caller's, plus the logical embedding tie when mapped."""
        if not self.mapped or given is True:
            return given
        return {**LOGICAL_TIES, **(given or {})}


def agreed_formats(
    formats: tuple[ModelFormat | None, ModelFormat | None],
    codes: Mapping[int, tuple[int, int]],
    sides: tuple[Sequence[int], Sequence[int]],
) -> FormatChoice:
    """The choice every rank makes from every rank's format codes (``ReshardError`` when the ranks
    holding one side disagree on its format)."""
    agreed = []
    for i, (word, ranks) in enumerate((("source", sides[0]), ("destination", sides[1]))):
        seen: dict[int, list[int]] = {}
        for r in ranks:
            seen.setdefault(codes[r][i], []).append(r)
        if len(seen) > 1:
            names = _names(formats)
            text = " vs ".join(
                f"{names.get(c, 'none')} on ranks {format_ranks(r)}" for c, r in sorted(seen.items())
            )
            raise ReshardError(f"the {word} ranks disagree on the model format: {text}")
        agreed.append(next(iter(seen), 0))
    mapped = all(agreed) and agreed[0] != agreed[1]
    return FormatChoice(mapped, formats[0], formats[1])


def _names(local: tuple[ModelFormat | None, ...]) -> dict[int, str]:
    out = {format_code(f): f.name for f in available_formats()}
    out.update({format_code(f): f.name for f in local if f is not None})
    return out


def logical_side(
    model: Any,
    side: str,
    fmt: ModelFormat,
    context: ExtractContext,
    ignore: Sequence[str],
    problems: Problems,
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """This rank's logical specs of ``model`` by ``fmt`` and its padding views (destination only).

    Unmapped physical tensors (unless ``ignore`` matches them), logical tensors given twice (all
    listed), a local piece that does not fit its layout, and destination parameters the format's
    views and padding do not cover exactly once (``coverage``) are recorded in ``problems``, not
    raised: every rank raises them together.
    """
    result = fmt.logical_specs(model, side, context)
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    unmapped = [n for n in result.unmapped if not any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    if unmapped:
        problems.unmapped[(side, fmt.name)] = unmapped
    seen: set[str] = set()
    twice: list[str] = []
    for spec in result.specs:
        name = spec.meta.name
        if name in seen and name not in twice:
            twice.append(name)
        seen.add(name)
        expected = spec.layout.local_shape(tuple(spec.meta.shape), context.rank)
        if spec.tensor is not None and tuple(spec.tensor.shape) != expected:
            problems.errors.append(
                f"format '{fmt.name}': {_word(side)} logical tensor {name} is held as "
                f"{tuple(spec.tensor.shape)}, its layout {spec.layout} gives {expected}"
            )
    if len(twice) == 1:
        problems.errors.append(f"format '{fmt.name}' gives the {_word(side)} logical tensor {twice[0]} twice")
    elif twice:
        problems.errors.append(
            f"format '{fmt.name}' gives {len(twice)} {_word(side)} logical tensors twice: {', '.join(twice)}"
        )
    if side == "dst":
        problems.errors += coverage_problems(model, result.specs, result.padding, fmt.name)
    return result.specs, (result.padding if side == "dst" else [])


def _word(side: str) -> str:
    return "source" if side == "src" else "destination"
