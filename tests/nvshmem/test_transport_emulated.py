"""``NvshmemCopyService`` end to end on CPU: the real transport, handshake, layouts, ledger and engine
in a 3-process Gloo world, with only NVSHMEM's memory and signals emulated (``nvshmem_emulator``)."""

from __future__ import annotations

import torch
from reshard_nvshmem.schedule import Message, StagingConfig, build_schedule

from reshard_core.testing.world import run_world

CONFIG = StagingConfig(slot_bytes=4096, slots=2)
# Per run: (src, dst, numel, dtype) messages in submission order. 4 KiB slots, so large messages
# take many rounds and reuse both slots; the signal counts carry over from run to run.
RUNS = [
    [(0, 1, 7500, "float32"), (0, 1, 5, "int16"), (1, 2, 50000, "bfloat16"), (2, 0, 4096, "uint8")]
    + [(1, 0, 0, "int8")],
    [(0, 1, 70000, "uint8"), (1, 0, 17500, "float32")],  # rank 2 takes no part and never calls run()
    [(s, d, 10000, "float16") for s in range(3) for d in range(3) if s != d],
]
# Two runs in flight at once (the executor starts the next batch before waiting for this one): rank 0
# sends to 1 in the first and to 2 in the second; its puts to 1 are held until 1 s after it called the
# first run's wait(), which must not return before they read the source.
OVERLAP = [[(0, 1, 8192, "uint8")], [(0, 2, 8192, "uint8")]]
MISMATCH = [(0, 1, 100, "uint8")]  # rank 1 posts a receive of 99 bytes instead


def _payload(run: int, src: int, dst: int, k: int, numel: int, dtype: str) -> torch.Tensor:
    dt = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator().manual_seed(((run * 8 + src) * 8 + dst) * 16 + k)
    return torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen).view(dt)


def _ranks_world(rank: int, world: int, slots: torch.Tensor, signals: torch.Tensor, lock) -> dict:
    import nvshmem_emulator
    from reshard_nvshmem import transport

    transport.load_nvshmem = lambda: (object(), None)
    transport.NvshmemRuntime.acquire = classmethod(lambda cls, nv, group: None)
    transport.NvshmemRuntime.release = classmethod(lambda cls, nv: None)
    transport.SymmetricStaging = lambda nv, cfg, group: nvshmem_emulator.EmulatedStaging(
        slots, signals, lock, rank, cfg
    )
    transport.NvshmemCopyService.unavailable_reason = classmethod(lambda cls: None)
    service = transport.NvshmemCopyService(None, timeout=60, slot_bytes=CONFIG.slot_bytes, slots=CONFIG.slots)
    out: dict = {"runs": []}
    for index, messages in enumerate(RUNS):
        if not any(rank in (src, dst) for src, dst, _, _ in messages):
            out["runs"].append("idle")
            continue
        expected, received = [], []
        for k, (src, dst, numel, dtype) in enumerate(messages):
            if src == rank:
                service.submit_send(_payload(index, src, dst, k, numel, dtype), dst, k)
            if dst == rank:
                buf = torch.zeros(numel, dtype=getattr(torch, dtype))
                service.submit_recv(buf, src, k)
                expected.append(_payload(index, src, dst, k, numel, dtype))
                received.append(buf)
        if index == 1:
            service.start().wait()
        else:
            service.run()
        pairs = zip(expected, received, strict=True)
        out["runs"].append(all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs))
    out["overlap"] = _overlapped_runs(service, rank)
    if rank in (0, 1):
        try:
            if rank == 0:
                service.submit_send(torch.zeros(100, dtype=torch.uint8), 1, 0)
            else:
                service.submit_recv(torch.zeros(99, dtype=torch.uint8), 0, 0)
            service.run()
        except Exception as exc:
            out["mismatch"] = f"{type(exc).__name__}: {exc}"
        try:
            service.run()
        except Exception as exc:
            out["after_failure"] = str(exc)
    service.close()
    service.close()
    return out


def _overlapped_runs(service, rank: int) -> bool:
    """OVERLAP on one service; True when every received byte is what was sent."""
    import threading

    (first,), (second,) = OVERLAP
    payloads = [_payload(9, src, dst, 0, numel, dtype) for src, dst, numel, dtype in (first, second)]
    if rank == 0:
        gate = service._staging.put_gate[1] = threading.Event()
        sent = [p.clone() for p in payloads]
        service.submit_send(sent[0], 1, 0)
        started = service.start()
        service.submit_send(sent[1], 2, 0)
        later = service.start()
        timer = threading.Timer(1.0, gate.set)
        timer.start()
        started.wait()
        sent[0].fill_(0)  # wait() returned: the source is the caller's again
        later.wait()
        timer.join()
        return True
    buf = torch.zeros(8192, dtype=torch.uint8)
    service.submit_recv(buf, 0, 0)
    service.run()
    return torch.equal(buf, payloads[rank - 1])


def test_service_moves_every_byte_across_runs_and_ranks() -> None:
    from nvshmem_emulator import shared_heap
    from torch import multiprocessing as mp

    slots, signals = shared_heap(3, CONFIG)
    results = run_world(_ranks_world, 3, slots, signals, mp.get_context("spawn").Lock(), timeout=240)
    assert [r["runs"] for r in results] == [[True, True, True], [True, True, True], [True, "idle", True]]
    assert [r["overlap"] for r in results] == [True, True, True]
    text = (
        "TransportError: rank 0 sends rank 1 1 message(s) of 100 bytes, "
        "but rank 1 posted receives for 1 message(s) of 99 bytes"
    )
    assert results[0]["mismatch"] == results[1]["mismatch"] == text
    assert results[0]["after_failure"] == "nvshmem service is unusable after a failed run; create a new one"
    # The words count exactly what the layouts planned: one arrival per piece, one credit per
    # (round, sender, receiver); the failed run moved nothing.
    runs = RUNS + OVERLAP
    planned = [(i, p) for i, run in enumerate(runs) for p in build_schedule(_messages(run), 3, CONFIG).pieces]
    assert int(signals[:, : CONFIG.slots].sum()) == len(planned) > 100
    assert int(signals[:, CONFIG.slots :].sum()) == len({(i, p.round, p.src, p.dst) for i, p in planned})


def _messages(run: list[tuple[int, int, int, str]]) -> list[Message]:
    orders: dict[tuple[int, int], int] = {}
    out = []
    for src, dst, numel, dtype in run:
        nbytes = numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        out.append(Message(src, dst, orders.get((src, dst), 0), nbytes))
        orders[(src, dst)] = orders.get((src, dst), 0) + 1
    return out


def test_conformance_suite_over_the_emulated_heap(tmp_path, monkeypatch) -> None:
    from nvshmem_emulator import HEAP_ENV, EmulatedNvshmemCopyService, file_heap

    from reshard_core.testing.conformance import run_conformance

    config = StagingConfig(slot_bytes=1 << 16, slots=2)  # the order check's 1 MiB messages take 16+ rounds
    file_heap(tmp_path, config)
    monkeypatch.setenv(HEAP_ENV, str(tmp_path))
    options = {"slot_bytes": config.slot_bytes, "slots": config.slots}
    results = run_conformance(EmulatedNvshmemCopyService, world_size=3, options=options)
    assert results == dict.fromkeys(results, "ok")
