"""``GlooCopyService`` and the shared P2P base beyond the conformance suite: availability, bad input,
failure messages, giving up on unfinished ops so peers fail fast, and the base's pure helpers."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from reshard_gloo import plugin
from reshard_gloo.transport import GlooCopyService

from reshard_core.errors import TransportError
from reshard_core.testing.world import run_world
from reshard_core.transport import QueuedOp, poll_until, remaining
from reshard_core.transport.p2p import describe_failure, list_ops


def test_gloo_is_available_here_and_the_plugin_says_so():
    assert GlooCopyService.unavailable_reason() is None
    assert plugin.unavailable_reason() is None
    assert (GlooCopyService.name, GlooCopyService.device, GlooCopyService.one_sided) == ("gloo", "any", False)


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(TransportError, match="^gloo transport needs an initialised torch.distributed group$"):
        GlooCopyService()


def test_failure_reasons_are_put_in_our_words():
    assert describe_failure(RuntimeError("[x.cc:78] Timed out waiting 1000ms for recv"), 1.0) == (
        "timed out after 1 s"
    )
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. GLHF")
    assert describe_failure(closed, None) == "connection closed by the peer (it exited, failed or gave up)"
    assert describe_failure(TimeoutError(), 2.5) == "timed out after 2.5 s"
    assert describe_failure(ValueError("first line\nsecond"), None) == "first line"


def test_op_lists_are_bounded():
    ops = [QueuedOp("send", torch.zeros(2), peer, peer) for peer in range(10)]
    text = list_ops(ops)
    assert text.startswith("send to rank 0 (task 0, 8 bytes), send to rank 1 (task 1, 8 bytes)")
    assert text.endswith("send to rank 7 (task 7, 8 bytes) and 2 more")


def test_remaining_time_never_reaches_zero_and_polling_times_out():
    assert remaining(None) is None
    assert remaining(time.monotonic() - 5) == 0.001
    poll_until(lambda: True, time.monotonic() - 1)  # already done: no timeout
    with pytest.raises(TimeoutError):
        poll_until(lambda: False, time.monotonic() + 0.01)


def _errors_world(rank, world):
    out = {}
    service = GlooCopyService(timeout=30)
    for key, call in {
        "strided": lambda: service.submit_send(torch.zeros(4, 4).t(), (rank + 1) % world, 1),
        "outsider": lambda: service.submit_recv(torch.zeros(4), world + 5, 2),
        "not_tensor": lambda: service.submit_send([1, 2], (rank + 1) % world, 3),
    }.items():
        try:
            call()
        except TransportError as exc:
            out[key] = str(exc)
    pair = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):  # a group limits who may be a peer; global rank numbers stay
        grouped = GlooCopyService(pair, timeout=30)
        try:
            grouped.submit_send(torch.zeros(1), 2, 4)
        except TransportError as exc:
            out["not_in_group"] = str(exc)
        peer = 1 - rank
        data = torch.full((3,), float(rank))
        got = torch.empty(3)
        grouped.submit_send(data, peer, 5)
        grouped.submit_recv(got, peer, 5)
        flight = grouped.start()  # issued, not yet waited
        flight.wait()
        flight.wait()  # waiting twice is harmless
        out["grouped"] = got.tolist()
        out["owns_group"] = grouped._owns_comm
        grouped.close()
        try:
            grouped.submit_send(data, peer, 6)
        except TransportError as exc:
            out["closed"] = str(exc)
    service.close()
    return out


@pytest.mark.slow
def test_bad_submissions_and_groups():
    results = run_world(_errors_world, 3, timeout=120)
    for rank, out in enumerate(results):
        peer = (rank + 1) % 3
        assert out["strided"] == f"gloo: send with rank {peer} (task 1): the tensor is not contiguous"
        assert out["outsider"] == "gloo: recv with rank 8 (task 2): rank 8 is not in the transport's group"
        assert out["not_tensor"] == f"gloo: send with rank {peer} (task 3): expected a torch.Tensor, got list"
    for rank in (0, 1):
        out = results[rank]
        assert out["not_in_group"] == (
            "gloo: send with rank 2 (task 4): rank 2 is not in the transport's group"
        )
        assert out["grouped"] == [float(1 - rank)] * 3
        assert out["owns_group"] is False
        assert out["closed"] == f"gloo: send with rank {1 - rank} (task 6): the transport is closed"


def _give_up_world(rank, world):
    if rank == 0:
        service = GlooCopyService(timeout=1.0)
        service.submit_recv(torch.empty(4), 1, 5)  # rank 1 never sends
        service.submit_recv(torch.empty(2), 2, 7)  # rank 2 sends late
        try:
            service.run()
        except TransportError as exc:
            time.sleep(4.0)  # stay alive: rank 2 must fail because we gave up, not because we exited
            return str(exc)
        return "no error"
    if rank == 2:
        time.sleep(2.5)
        service = GlooCopyService(timeout=60.0)
        service.submit_send(torch.ones(2), 0, 7)
        try:
            service.run()
        except TransportError as exc:
            return str(exc)
        return "no error"
    time.sleep(6.0)  # stalled: never sends, never exits before rank 0 gave up
    return "stalled"


@pytest.mark.slow
def test_a_timeout_names_every_unfinished_op_and_releases_the_peers():
    results = run_world(_give_up_world, 3, timeout=120)
    assert results[0] == (
        "gloo: recv from rank 1 (task 5, 16 bytes) failed: timed out after 1 s; "
        "also unfinished: recv from rank 2 (task 7, 8 bytes)"
    )
    # rank 0 gave up on rank 2's message, so rank 2 fails at once instead of waiting out its 60 s
    assert "send to rank 0 (task 7, 8 bytes)" in results[2]
    assert results[2].endswith("connection closed by the peer (it exited, failed or gave up)")
    assert results[1] == "stalled"


def _device_staging_world(rank, world):
    """Rank 0 sends "device" tensors (CPU tensors the transport is told to stage through host memory,
    with its stream sync and isend logged) to rank 1 the way the executor does: each message its own
    round, then the waits. Returns the log and whether every byte arrived."""
    from reshard_gloo import transport

    device: set[int] = set()
    log: list[str] = []
    transport._on_device = lambda t: id(t.untyped_storage()) in device
    transport._host_buffer = lambda n: torch.empty(n, dtype=torch.uint8)
    transport._sync_stream = lambda dev: log.append("sync")
    isend = dist.isend

    def logged_isend(tensor, dst=None, group=None, group_dst=None):
        log.append(f"isend {tensor.numel()}")
        return isend(tensor, dst, group=group, group_dst=group_dst)

    dist.isend = logged_isend
    service = GlooCopyService(timeout=60.0)
    ok = True
    for batch in range(2):
        # (bytes, staged): the first batch has a CPU send among the device ones
        sizes = [(8, True), (16, True), (24, batch == 1), (32, True)]
        tensors = [torch.full((n,), 10 * batch + k + 1, dtype=torch.uint8) for k, (n, _) in enumerate(sizes)]
        if rank == 1:
            tensors = [torch.zeros_like(t) for t in tensors]
        for t, (_, staged) in zip(tensors, sizes, strict=True):
            if staged:
                device.add(id(t.untyped_storage()))
        handles = []
        for k, t in enumerate(tensors):
            (service.submit_send if rank == 0 else service.submit_recv)(t, 1 - rank, k)
            handles.append(service.start())
        log.append("waits")
        for h in handles:
            h.wait()
        if rank == 1:
            ok &= all(torch.equal(t, torch.full_like(t, 10 * batch + k + 1)) for k, t in enumerate(tensors))
    # a mixed round (the executor's one round per batch on other transports): one sync for its sends
    mine = torch.full((40,), 7, dtype=torch.uint8)
    theirs = torch.zeros(40, dtype=torch.uint8)
    device.update({id(mine.untyped_storage()), id(theirs.untyped_storage())})
    service.submit_send(mine, 1 - rank, 9)
    service.submit_recv(theirs, 1 - rank, 9)
    service.run()
    ok &= torch.equal(theirs, mine)
    service.close()
    dist.isend = isend
    return log, ok


@pytest.mark.slow
def test_device_sends_sync_once_per_batch_not_per_message():
    results = run_world(_device_staging_world, 2, timeout=120)
    assert [ok for _, ok in results] == [True, True]
    # rank 0, first batch: the two staged sends are held, flushed with one sync before the CPU send
    # (order to the peer kept), the last one goes with the waits after one more sync. Second batch, all
    # staged: one sync. The mixed round syncs once.
    first = ["sync", "isend 8", "isend 16", "isend 24", "waits", "sync", "isend 32"]
    second = ["waits", "sync", "isend 8", "isend 16", "isend 24", "isend 32"]
    assert results[0][0] == first + second + ["sync", "isend 40"]
    assert results[1][0] == ["waits", "waits", "sync", "isend 40"]  # rank 1 sends only in the mixed round
