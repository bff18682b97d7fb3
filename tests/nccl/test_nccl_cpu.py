"""The ``nccl`` transport's CPU-testable logic: availability reasons, grouping by device and the stream
ordering, checked on stand-in streams, requests and tensors (no CUDA needed)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from reshard_nccl import plugin, streams
from reshard_nccl.transport import NcclCopyService

from reshard_core.errors import TransportError
from reshard_core.transport import Issued, QueuedOp

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")


@needs_no_cuda
def test_unavailable_without_cuda_with_the_reason():
    assert NcclCopyService.unavailable_reason() == "CUDA is not available"
    assert plugin.unavailable_reason() == "CUDA is not available"
    assert (NcclCopyService.name, NcclCopyService.device, NcclCopyService.one_sided) == (
        "nccl",
        "cuda",
        False,
    )


@needs_no_cuda
def test_constructing_without_cuda_is_one_clear_error():
    with pytest.raises(TransportError, match="^nccl transport is unavailable: CUDA is not available$"):
        NcclCopyService()


def test_a_torch_without_nccl_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert NcclCopyService.unavailable_reason() == "torch was built without NCCL"


def test_ops_are_grouped_by_device_keeping_submission_order():
    ops = [("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 0)]
    assert streams.group_by_device(ops, lambda op: op[1]) == {
        0: [("a", 0), ("c", 0), ("e", 0)],
        1: [("b", 1), ("d", 1)],
    }


class Log:
    """Records the order of stream operations across stand-in objects."""

    def __init__(self):
        self.events: list[str] = []

    def stream(self, name: str):
        log = self

        class Stream:
            def wait_stream(self, other):
                log.events.append(f"{name}.wait_stream({other.name})")

        s = Stream()
        s.name = name
        return s

    def use(self, stream):
        @contextlib.contextmanager
        def ctx():
            self.events.append(f"enter {stream.name}")
            yield
            self.events.append(f"exit {stream.name}")

        return ctx()


class FakeTensor:
    """Just enough of a CUDA tensor for the transport's bookkeeping."""

    def __init__(self, log: Log, name: str, device: str = "cuda:0"):
        self.log, self.label, self.device, self.nbytes, self.is_cuda = log, name, device, 16, True

    def record_stream(self, stream):
        self.log.events.append(f"{self.label}.record_stream({stream.name})")

    def reshape(self, *shape):
        return self

    def view(self, dtype):
        return self


class FakeWork:
    def __init__(self, log: Log, done_after: int = 0):
        self.log, self.polls, self.done_after = log, 0, done_after

    def is_completed(self):
        self.polls += 1
        return self.polls > self.done_after

    def wait(self):
        self.log.events.append("work.wait")


def test_stream_rules_in_order():
    log = Log()
    side, producer, consumer = log.stream("side"), log.stream("producer"), log.stream("consumer")
    tensors = [FakeTensor(log, "t0"), FakeTensor(log, "t1")]
    result = streams.launch_on_side_stream(
        side, producer, tensors, lambda: log.events.append("issue") or 7, log.use
    )
    streams.complete_on_side_stream(side, FakeWork(log).wait, log.use)
    streams.release_to_consumer(side, consumer)
    assert result == 7
    assert log.events == [
        "side.wait_stream(producer)",  # never read a weight before its producer finished writing it
        "t0.record_stream(side)",
        "t1.record_stream(side)",
        "enter side",
        "issue",  # NCCL's stream waits on the side stream
        "exit side",
        "enter side",
        "work.wait",  # the side stream waits on NCCL
        "exit side",
        "consumer.wait_stream(side)",  # the consumer uses data only after it arrived
    ]


def _service_without_cuda(monkeypatch, log: Log, requests_per_batch: str = "one per op") -> NcclCopyService:
    """An ``NcclCopyService`` wired to stand-ins for CUDA streams and NCCL (``__init__`` skipped)."""
    service = object.__new__(NcclCopyService)
    service.timeout, service.comm, service._side, service._closed = None, "comm", {}, False
    service._peer_index = {0: 0, 1: 1, 2: 2}  # the communicator's ranks are the global ones
    streams_by_name = {}

    def stream_for(name):
        return streams_by_name.setdefault(name, log.stream(name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: stream_for(f"side[{device}]"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream_for(f"current[{device}]"))
    monkeypatch.setattr(torch.cuda, "stream", log.use)

    def p2p_op(start, tensor, peer=None, group=None, tag=0, group_peer=None):
        return (start.__name__, tensor.label, group_peer, group)

    def batch(p2p_ops):
        log.events.append(f"batch_isend_irecv({p2p_ops})")
        count = len(p2p_ops) if requests_per_batch == "one per op" else 1
        return [FakeWork(log) for _ in range(count)]

    monkeypatch.setattr(torch.distributed, "P2POp", p2p_op)
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", batch)
    return service


@pytest.mark.parametrize("requests_per_batch", ["one per op", "one per batch"])
def test_one_batched_call_per_device_on_its_side_stream(monkeypatch, requests_per_batch):
    log = Log()
    service = _service_without_cuda(monkeypatch, log, requests_per_batch)
    ops = [
        QueuedOp("send", FakeTensor(log, "a", "cuda:0"), 1, 10),
        QueuedOp("recv", FakeTensor(log, "b", "cuda:1"), 2, 11),
        QueuedOp("recv", FakeTensor(log, "c", "cuda:0"), 1, 12),
    ]
    issued = service._issue(ops)
    assert log.events == [
        "side[cuda:0].wait_stream(current[cuda:0])",
        "a.record_stream(side[cuda:0])",
        "c.record_stream(side[cuda:0])",
        "enter side[cuda:0]",
        "batch_isend_irecv([('isend', 'a', 1, 'comm'), ('irecv', 'c', 1, 'comm')])",
        "exit side[cuda:0]",
        "side[cuda:1].wait_stream(current[cuda:1])",
        "b.record_stream(side[cuda:1])",
        "enter side[cuda:1]",
        "batch_isend_irecv([('irecv', 'b', 2, 'comm')])",
        "exit side[cuda:1]",
    ]
    covered = [[op.task_id for op in item.ops] for item in issued]
    assert covered == ([[10], [12], [11]] if requests_per_batch == "one per op" else [[10, 12], [11]])
    log.events.clear()
    for item in issued:
        service._wait_issued(item, None)  # no timeout: stream-ordered, no CPU polling
    service._finish(ops)
    waits = log.events[:-2]
    assert waits == ["enter side[cuda:0]", "work.wait", "exit side[cuda:0]"] * (len(issued) - 1) + [
        "enter side[cuda:1]",
        "work.wait",
        "exit side[cuda:1]",
    ]
    assert sorted(log.events[-2:]) == [  # then each device's consumer waits on its side stream
        "current[cuda:0].wait_stream(side[cuda:0])",
        "current[cuda:1].wait_stream(side[cuda:1])",
    ]


def test_with_a_timeout_the_cpu_polls_until_done_or_deadline(monkeypatch):
    log = Log()
    service = _service_without_cuda(monkeypatch, log)
    op = QueuedOp("recv", FakeTensor(log, "a"), 1, 3)
    slow = FakeWork(log, done_after=3)
    service._wait_issued(Issued(slow, [op]), time.monotonic() + 60)
    assert slow.polls == 4 and log.events[-2:] == ["work.wait", "exit side[cuda:0]"]
    never = FakeWork(log, done_after=10**9)
    with pytest.raises(TimeoutError):
        service._wait_issued(Issued(never, [op]), time.monotonic() + 0.01)


def test_cpu_tensors_are_refused_before_anything_moves(monkeypatch):
    log = Log()
    service = _service_without_cuda(monkeypatch, log)
    with pytest.raises(TransportError) as info:
        service._check_tensor(QueuedOp("send", torch.zeros(2), 1, 9), "nccl: send with rank 1 (task 9)")
    assert str(info.value) == "nccl: send with rank 1 (task 9): nccl moves CUDA tensors only, got one on cpu"


def test_giving_up_aborts_only_the_transports_own_communicator(monkeypatch):
    """``_abort_process_group(None)`` aborts every group of the job: the transport must never pass
    None, nor a group it does not own (it builds its own over the group's ranks)."""
    made, aborted = [], []
    monkeypatch.setattr(
        torch.distributed,
        "new_group",
        lambda ranks, backend, **kw: made.append((ranks, backend, kw)) or "own",
    )
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", aborted.append)
    service = object.__new__(NcclCopyService)
    service.members = frozenset({0, 1})
    assert service._resolve_group(None) == ("own", True)  # even when the default group is NCCL
    assert made == [([0, 1], "nccl", {"use_local_synchronization": True})]
    service.comm, service._owns_comm, service._closed = "own", True, False
    service._give_up(None, 0)
    assert aborted == ["own"] and service._closed
    service.comm, service._owns_comm = None, False
    service._give_up(None, 0)
    assert aborted == ["own"]  # nothing more: never _abort_process_group(None)
