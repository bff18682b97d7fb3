"""Layout strings on the command line, in Megatron-Core's meaning.

``tp=2,pp=2,ep=4,dp=8`` means what Megatron's arguments mean: the world is ``tp·pp·cp·dp·fsdp``
ranks and expert parallelism is carved out of data parallelism (``ep`` must divide ``dp``; the
expert grid ``etp·ep·edp`` fills ``tp·cp·dp``, so ``etp·ep`` must divide it). The simulator's own
``Parallel`` counts ``ep`` as a factor of its own, so ``parse_cli_layout`` hands it ``dp / ep``.

``check_fits`` refuses a layout the model cannot be built in: a TP size that does not divide the
attention heads, or that neither divides nor is a multiple of the query groups (Megatron asserts
both), unless the caller allows it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..simulate.parallel import Parallel, parse_parallel

if TYPE_CHECKING:
    from ..catalogue.shapes import ModelShapes


def parse_cli_layout(text: str) -> Parallel:
    """The simulator's ``Parallel`` for a Megatron-meaning layout string; ``ValueError`` with a
    one-line reason."""
    par = parse_parallel(text)
    if par.dp % par.ep:
        raise ValueError(
            f"bad layout {text!r}: ep={par.ep} must divide dp={par.dp} "
            "(EP is carved out of data parallelism: world = tp·pp·cp·dp)"
        )
    if (par.tp * par.cp * par.dp) % (par.expert_tp * par.ep):
        raise ValueError(
            f"bad layout {text!r}: etp·ep={par.expert_tp * par.ep} "
            f"must divide tp·cp·dp={par.tp * par.cp * par.dp}"
        )
    return dataclasses.replace(par, dp=par.dp // par.ep)


def megatron_text(par: Parallel) -> str:
    """``par`` written back in Megatron's meaning (``dp`` counts the EP ranks again)."""
    return str(dataclasses.replace(par, dp=par.dp * par.ep))


def check_fits(model: ModelShapes, text: str, par: Parallel) -> None:
    """``ValueError`` when ``par``'s TP size does not divide ``model``'s attention heads, or neither
    divides nor is a multiple of its query groups (Megatron-Core lays out TP > query groups by
    splitting each group's fused rows over TP / groups ranks); each checked when the model states it."""
    heads, groups = model.heads, model.kv_groups
    if heads is not None and heads % par.tp:
        raise ValueError(
            f"bad layout {text!r}: tp={par.tp} does not divide the model's {heads} attention heads "
            "(--allow-uneven plans it anyway)"
        )
    if groups is not None and groups % par.tp and par.tp % groups:
        raise ValueError(
            f"bad layout {text!r}: tp={par.tp} neither divides nor is a multiple of the model's {groups} "
            "query groups (--allow-uneven plans it anyway)"
        )
