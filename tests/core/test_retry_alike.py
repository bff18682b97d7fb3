"""A training loop that catches a failed refit and tries again: every attempt has the same outcome
on every rank, and good attempts after bad ones are exact.

One 3-rank Gloo world runs every case one after another, as a long job would meet them: rank 0
holds the (8, 4) source, ranks 1 and 2 hold 4-row halves of the destination. For each kind of
rank-local error, rank 1 fails on its own for one attempt, then for two, and then every rank makes
three good attempts; the last kind is a rank that calls ``refuse_refit`` with its own error instead
of ``refit``. A rank whose own checks fail still joins the refit's agreement round and
carries its error there, so every rank raises that rank's text and no later collective pairs with
the wrong call (before, ranks 0 and 2 reported success for the failed attempt, and later attempts
timed out or killed a rank with a Gloo collective mismatch).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow

TIMEOUT = 20.0
SOURCE = torch.arange(32.0).reshape(8, 4)

KINDS = {
    "not_a_module": "ReshardError: rank 1: the destination model must be a torch.nn.Module, a list of them "
    "(pipeline chunks) or None, not dict",
    "lazy": "ReshardError: rank 1: the destination model's tensor w is uninitialized (a lazy module's "
    "parameter): run a forward (or initialize it) before refitting",
    "unknown_format": "PluginError: rank 1: unknown model format 'no-such-format'",
    "unknown_transport": "PluginError: rank 1: unknown transport 'carrier-pigeon'",
    "plugin_hook": "PlanError: rank [1]: RuntimeError: the transforms hook of a plugin broke",
    "refused": "ReshardError: rank 1: RuntimeError: its receive buffers could not be allocated",
}
"""What every rank raises when rank 1 fails in that way (the start of the text)."""


class _BrokenHook:
    from reshard_core import hookimpl

    @hookimpl
    def reshard_transforms(self, model, specs):
        raise RuntimeError("the transforms hook of a plugin broke")


def _models(rank: int):
    from reshard_core import declare_layout

    if rank == 0:
        src = nn.Module()
        src.w = nn.Parameter(SOURCE.clone())
        declare_layout(src.w, ranks=(0,))
        return src, None
    dst = nn.Module()
    dst.w = nn.Parameter(torch.zeros(4, 4))
    declare_layout(dst.w, dim=0, ranks=(1, 2))
    return None, dst


def _attempt(rank: int, kind: str | None) -> str:
    """One refit; ``kind``: how rank 1 breaks it (None: a good attempt). Returns the outcome."""
    import reshard_core
    from reshard_core.plugins import unregister_plugin

    src, dst = _models(rank)
    options: dict = {"timeout": TIMEOUT}
    hook = None
    if rank == 1 and kind is not None:
        if kind == "not_a_module":
            dst = {"w": dst.w}
        elif kind == "lazy":
            dst = nn.Module()
            dst.w = nn.parameter.UninitializedParameter()
        elif kind == "unknown_format":
            options["dst_format"] = "no-such-format"
        elif kind == "unknown_transport":
            options["transport"] = "carrier-pigeon"
        elif kind == "plugin_hook":
            hook = reshard_core.register_plugin(_BrokenHook(), name="broken-hook")
    try:
        if rank == 1 and kind == "refused":  # its own preparation failed: it joins the refit to say so
            reshard_core.refuse_refit(RuntimeError("its receive buffers could not be allocated"), **options)
        reshard_core.refit(src, dst, **options)
    except reshard_core.ReshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if hook is not None:
            unregister_plugin(hook)
    if dst is not None and not torch.equal(dst.w.detach(), SOURCE[4 * (rank - 1) : 4 * rank]):
        return "wrong values"
    return "ok"


def _loop(rank: int, world: int) -> list[tuple[str, int, str]]:
    """``(kind, attempt, outcome)`` for every attempt of every case, in order."""
    out = []
    for kind in KINDS:
        for bad in (1, 2):
            for attempt in range(bad + 3):
                out.append((f"{kind}x{bad}", attempt, _attempt(rank, kind if attempt < bad else None)))
    return out


def test_every_attempt_has_one_outcome_on_every_rank_and_good_ones_are_exact():
    per_rank = run_world(_loop, 3, timeout=600, pg_timeout=60)
    for (case, attempt, outcome), *others in zip(*per_rank, strict=True):
        assert [o[2] for o in others] == [outcome, outcome], (case, attempt, per_rank)
        kind, bad = case.rsplit("x", 1)
        if attempt < int(bad):
            assert outcome.startswith(KINDS[kind]), (case, attempt, outcome)
        else:
            assert outcome == "ok", (case, attempt, outcome)
