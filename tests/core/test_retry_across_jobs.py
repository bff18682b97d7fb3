"""A trainer job retrying refits into an engine job (a ``TransferGroup``), while one trainer rank
fails on its own: every attempt has the same outcome on all four ranks of both jobs, the engine's
ranks hear the trainer rank's error at once (not after the timeout), and good attempts are exact.

Trainer rank 1 breaks one attempt in each way below, then every rank makes two good attempts; the
same loop runs through ``refit`` and through a prepared ``Session.refit`` (whose failed attempt
every rank answers by preparing again, as its error says).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from reshard_core import TransferGroup, declare_layout
from reshard_core.testing.world import free_port, run_jobs

pytestmark = pytest.mark.slow

ROWS, COLS = 8, 6
TIMEOUT = 30.0
AT_ONCE = 10.0  # well under TIMEOUT: nobody waited it out

KINDS = {
    "not_a_module": "ReshardError: rank 1: the source model must be a torch.nn.Module, a list of them "
    "(pipeline chunks) or None, not dict",
    "refused": "ReshardError: rank 1: RuntimeError: its source could not be gathered",
    "replaced": "ReshardError: rank 1: the prepared session no longer fits its models (a tensor was "
    "replaced, reshaped, moved or re-laid out); call reshard_core.prepare() again on every rank",
}
"""What every rank of both jobs raises when trainer rank 1 fails that way: ``not_a_module`` through
``refit`` (a prepared session takes no models), ``replaced`` under a prepared session (through
``refit`` a replaced tensor is simply a new plan), ``refused`` (``refuse_refit``) under both."""


def _weights(step: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


def _model(w: torch.Tensor, dim: int) -> nn.Module:
    model = nn.Module()
    model.w = nn.Parameter(w, requires_grad=False)
    declare_layout(model.w, dim=dim)  # over this job's ranks 0, 1
    return model


def _cases(use_session: bool) -> list[str | None]:
    """The attempts, in order: a kind of failure on trainer rank 1, or None for a good attempt."""
    kinds = [k for k in KINDS if k != ("not_a_module" if use_session else "replaced")]
    return [attempt for kind in kinds for attempt in (kind, None, None)]


def _timed(attempt: Callable[[], str]) -> tuple[str, float]:
    """``(outcome, seconds)`` of one attempt: its own text, or the error it raised."""
    import reshard_core

    start = time.monotonic()
    try:
        text = attempt()
    except reshard_core.ReshardError as exc:
        text = f"{type(exc).__name__}: {exc}"
    return text, time.monotonic() - start


def _trainer(rank: int, world: int, port: int, use_session: bool) -> list[tuple[str, float]]:
    import reshard_core

    group = TransferGroup.join("127.0.0.1", port, rank=rank, size=4, job_ranks=range(0, 2), timeout=TIMEOUT)
    model = _model(_weights(0).chunk(2, 0)[rank].clone(), 0)
    options = reshard_core.RefitOptions(group=group, timeout=TIMEOUT)
    session = reshard_core.prepare(model, None, options) if use_session else None
    out = []
    for step, kind in enumerate(_cases(use_session)):
        model.w.data.copy_(_weights(step).chunk(2, 0)[rank])
        broken = kind if rank == 1 else None
        if broken == "replaced":
            model.w = nn.Parameter(model.w.detach().clone(), requires_grad=False)
            declare_layout(model.w, dim=0)

        def attempt(broken: str | None = broken, session: reshard_core.Session | None = session) -> str:
            if broken == "refused":
                reshard_core.refuse_refit(RuntimeError("its source could not be gathered"), options)
            src = {"w": model.w} if broken == "not_a_module" else model
            session.refit() if session is not None else reshard_core.refit(src, None, options)
            return "ok"

        out.append(_timed(attempt))
        if session is not None and out[-1][0] != "ok":  # as the error says: prepare again
            session = reshard_core.prepare(model, None, options)
    group.close()
    return out


def _engine(rank: int, world: int, port: int, use_session: bool) -> list[tuple[str, float]]:
    import reshard_core

    group = TransferGroup.join("127.0.0.1", port, rank=2 + rank, size=4, job_ranks=range(2, 4),
                               timeout=TIMEOUT)  # fmt: skip
    model = _model(torch.full((ROWS, COLS // 2), float("nan")), 1)
    options = reshard_core.RefitOptions(group=group, timeout=TIMEOUT)
    session = reshard_core.prepare(None, model, options) if use_session else None
    out = []
    for step, _ in enumerate(_cases(use_session)):

        def attempt(step: int = step, session: reshard_core.Session | None = session) -> str:
            session.refit() if session is not None else reshard_core.refit(None, model, options)
            return "ok" if torch.equal(model.w, _weights(step).chunk(2, 1)[rank]) else "wrong values"

        out.append(_timed(attempt))
        if session is not None and out[-1][0] != "ok":
            session = reshard_core.prepare(None, model, options)
    group.close()
    return out


@pytest.mark.parametrize("use_session", [False, True], ids=["refit", "session"])
def test_every_attempt_has_one_outcome_in_both_jobs_and_the_engine_hears_at_once(use_session: bool) -> None:
    port = free_port()
    trainer, engine = run_jobs(
        (_trainer, 2, (port, use_session)), (_engine, 2, (port, use_session)), timeout=300
    )
    ranks = [*trainer, *engine]
    for step, kind in enumerate(_cases(use_session)):
        texts = [r[step][0] for r in ranks]
        assert texts == [texts[0]] * 4, (step, kind, texts)
        if kind is None:
            assert texts[0] == "ok", (step, texts[0])
        else:
            assert texts[0].startswith(KINDS[kind]), (step, kind, texts[0])
            seconds = [r[step][1] for r in engine]
            assert max(seconds) < AT_ONCE, (step, kind, seconds)
