"""Refits between separate jobs: two Gloo worlds of their own, joined by a ``TransferGroup``.

Job 0 ("trainer", 2 ranks) holds the source, job 1 ("engine", 2 ranks) the destination; each
declares its layouts in its own world's ranks (both use ranks 0 and 1), so a refit that did not
shift them into the group's ranks would plan over the wrong processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

from reshard_core import TransferGroup, TransportError, declare_layout, prepare, refit
from reshard_core.testing.world import free_port, outcome, run_jobs

pytestmark = pytest.mark.slow

ROWS, COLS = 8, 6


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g)}


class _Model(nn.Module):
    def __init__(self, w: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)
        self.b = nn.Parameter(b, requires_grad=False)


def _join(port: int, rank: int, job: range) -> TransferGroup:
    return TransferGroup.join("127.0.0.1", port, rank=rank, size=4, job_ranks=job, timeout=30)


def _trainer(rank: int, world: int, port: int, steps: int, use_session: bool) -> list[str]:
    group = _join(port, rank, range(0, 2))
    full = _weights(0)
    model = _Model(full["w"].chunk(2, 0)[rank].clone(), full["b"].clone())
    declare_layout(model.w, dim=0)  # rows over this job's ranks 0, 1
    declare_layout(model.b)
    session = prepare(model, None, group=group, timeout=30) if use_session else None
    reports = []
    for step in range(steps):
        full = _weights(step)
        model.w.data.copy_(full["w"].chunk(2, 0)[rank])
        model.b.data.copy_(full["b"])
        report = session.refit() if session else refit(model, None, group=group, timeout=30)
        reports.append(report.rank)
    group.close()
    return reports


def _engine(rank: int, world: int, port: int, steps: int, use_session: bool) -> list[bool]:
    group = _join(port, 2 + rank, range(2, 4))
    model = _Model(torch.full((ROWS, COLS // 2), float("nan")), torch.full((COLS,), float("nan")))
    declare_layout(model.w, dim=1)  # columns over this job's ranks 0, 1
    declare_layout(model.b)
    session = prepare(None, model, group=group, timeout=30) if use_session else None
    exact = []
    for step in range(steps):
        report = session.refit() if session else refit(None, model, group=group, timeout=30)
        full = _weights(step)
        exact.append(
            report.rank == 2 + rank
            and torch.equal(model.w, full["w"].chunk(2, 1)[rank])
            and torch.equal(model.b, full["b"])
        )
    group.close()
    return exact


@pytest.mark.parametrize("use_session", [False, True], ids=["refit", "session"])
def test_a_trainer_job_refits_an_engine_job_through_a_transfer_group(use_session: bool) -> None:
    port = free_port()
    trainer, engine = run_jobs(
        (_trainer, 2, (port, 3, use_session)), (_engine, 2, (port, 3, use_session)), timeout=120
    )
    assert trainer == [[0, 0, 0], [1, 1, 1]]
    assert engine == [[True] * 3, [True] * 3]


def _fsdp_trainer(rank: int, world: int, port: int) -> str:
    group = _join(port, rank, range(0, 2))
    mesh = DeviceMesh("cpu", [0, 1])
    model = _Model(_weights(7)["w"], _weights(7)["b"])
    model.w = nn.Parameter(distribute_tensor(model.w.data, mesh, [Shard(0)]), requires_grad=False)
    model.b = nn.Parameter(distribute_tensor(model.b.data, mesh, [Shard(0)]), requires_grad=False)
    refit(model, None, group=group, timeout=30)
    group.close()
    return "sent"


def _whole_engine(rank: int, world: int, port: int) -> bool:
    group = _join(port, 2 + rank, range(2, 4))
    model = _Model(torch.zeros(ROWS, COLS), torch.zeros(COLS))  # undeclared: whole on every engine rank
    refit(None, model, group=group, timeout=30)
    group.close()
    return torch.equal(model.w, _weights(7)["w"]) and torch.equal(model.b, _weights(7)["b"])


def test_dtensor_meshes_of_the_trainer_job_are_read_in_its_own_ranks() -> None:
    port = free_port()
    trainer, engine = run_jobs((_fsdp_trainer, 2, (port,)), (_whole_engine, 2, (port,)), timeout=120)
    assert trainer == ["sent", "sent"]
    assert engine == [True, True]


def _lonely(rank: int, world: int, port: int) -> str:
    return outcome(
        lambda: TransferGroup.join("127.0.0.1", port, rank=1, size=2, job_ranks=range(1, 2), timeout=2)
    )


def test_an_address_nobody_hosts_is_one_transport_error_naming_it() -> None:
    port = free_port()
    [[text]] = run_jobs((_lonely, 1, (port,)), timeout=60)
    assert text.startswith(
        f"TransportError: transfer group rank 1: could not reach the rendezvous store at 127.0.0.1:{port} "
        "within 2 s: "
    ), text


@pytest.mark.parametrize(
    ("rank", "size", "job", "message"),
    [
        (0, 4, range(2, 4), "transfer group: rank 0 is not in its job's ranks range(2, 4)"),
        (3, 3, range(2, 4), "transfer group: job_ranks range(2, 4) do not fit a group of 3 ranks"),
        (0, 2, [0, 1], "transfer group: job_ranks must be a non-empty range, got [0, 1]"),
    ],
)
def test_bad_ranks_are_refused_before_any_connection(rank, size, job, message) -> None:
    with pytest.raises(TransportError) as info:
        TransferGroup.join("127.0.0.1", 1, rank=rank, size=size, job_ranks=job)
    assert str(info.value) == message
