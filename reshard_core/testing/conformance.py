"""The transport conformance suite: one shared scenario every ``CopyService`` runs.

``run_conformance(transport_cls)`` spawns one local Gloo world (``world.run_world``), runs every
check on every rank, and returns ``{check name: "ok" or what failed}``; ``assert_conformance`` raises
when any check failed. Pytest users can run the world once in a module fixture and parametrize a
test over ``CHECK_NAMES``::

    @pytest.fixture(scope="module")
    def results():
        return run_conformance(MyCopyService, world_size=3)

    @pytest.mark.parametrize("check", CHECK_NAMES)
    def test_conformance(results, check):
        assert results[check] == "ok"

``transport_cls`` must be importable by name (spawned processes unpickle it) and constructible as
``transport_cls(group=None, timeout=seconds, **options)``. With ``device="cuda"`` every rank uses
GPU ``rank % device_count`` and submits CUDA tensors. Each check builds its own transport and
closes it; task ids are unique per (sender, receiver, message), so one-sided transports that pair by
task id work as well as two-sided ones that pair by submission order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TransportError
from .world import run_world

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
"""Dtypes the dtype check sends; float8 and bfloat16 must arrive bit for bit."""

TIMEOUT_CHECK_SECONDS = 1.0


def payload(seed: int, shape: Sequence[int], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Deterministic random bytes viewed as ``dtype`` (any bit pattern, NaNs included; bools 0/1)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(tuple(shape)).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two tensors of one dtype and shape (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def _task(src: int, dst: int, k: int, world: int) -> int:
    return (src * world + dst) * 1000 + k


def _exchange(
    transport: Any, rank: int, world: int, messages: Callable[[int, int], list[torch.Tensor]], device: str
) -> list[str]:
    """Every rank sends ``messages(rank, peer)`` to every other peer and checks what it receives."""
    expected, received = {}, {}
    for peer in range(world):
        if peer == rank:
            continue
        for k, tensor in enumerate(messages(rank, peer)):
            transport.submit_send(tensor, peer, _task(rank, peer, k, world))
        for k, tensor in enumerate(messages(peer, rank)):
            buffer = torch.empty_like(tensor)
            if buffer.dtype.is_floating_point:
                buffer.fill_(float("nan"))
            elif buffer.numel():
                buffer.zero_()
            transport.submit_recv(buffer, peer, _task(peer, rank, k, world))
            expected[(peer, k)], received[(peer, k)] = tensor, buffer
    transport.run()
    return [
        f"message {k} from rank {peer} ({sent.dtype}, {tuple(sent.shape)}) differs"
        for (peer, k), sent in expected.items()
        if not same_bytes(sent, received[(peer, k)])
    ]


def check_dtypes(transport: Any, rank: int, world: int, device: str) -> None:
    """Every dtype, bfloat16 and float8 included, arrives bit for bit from every peer (never from self)."""

    def messages(src: int, dst: int) -> list[torch.Tensor]:
        return [payload(src * 100 + dst * 10 + i, (3, 5), dt, device) for i, dt in enumerate(DTYPES)]

    _fail_on(_exchange(transport, rank, world, messages, device))


def check_order(transport: Any, rank: int, world: int, device: str) -> None:
    """Several messages per peer pair in submission order: equal sizes first, then very different ones."""

    def equal(src: int, dst: int) -> list[torch.Tensor]:
        return [payload(src * 7 + dst * 3 + k, (64,), torch.uint8, device) for k in range(6)]

    sizes = (1 << 20, 3, 50_000, 1, 4096)

    def mixed(src: int, dst: int) -> list[torch.Tensor]:
        return [payload(src * 7 + dst * 3 + n, (n,), torch.uint8, device) for n in sizes]

    _fail_on(_exchange(transport, rank, world, equal, device))
    _fail_on(_exchange(transport, rank, world, mixed, device))
    _fail_on(_exchange(transport, rank, world, lambda s, d: mixed(s, d)[::-1], device))


def check_shapes(transport: Any, rank: int, world: int, device: str) -> None:
    """Scalars, n-d tensors and empty tensors keep their bytes."""

    def messages(src: int, dst: int) -> list[torch.Tensor]:
        shapes = [(), (2, 3, 4), (0,), (5, 0, 2), (1,)]
        return [payload(src + dst + 31 * i, s, torch.bfloat16, device) for i, s in enumerate(shapes)]

    _fail_on(_exchange(transport, rank, world, messages, device))


def check_empty_run(transport: Any, rank: int, world: int, device: str) -> None:
    """run() with nothing queued returns at once, twice in a row."""
    transport.run()
    transport.run()


def check_bad_input(transport: Any, rank: int, world: int, device: str) -> None:
    """Sending to or receiving from oneself is refused with ``TransportError`` before anything moves."""
    tensor = torch.zeros(4, device=device)
    for submit in (transport.submit_send, transport.submit_recv):
        try:
            submit(tensor, rank, 0)
        except TransportError as exc:
            if f"rank {rank}" not in str(exc):
                raise AssertionError(f"{submit.__name__}: error does not name rank {rank}: {exc}") from exc
        else:
            raise AssertionError(f"{submit.__name__} to the rank itself was accepted")
    transport.run()  # the refused ops left nothing queued


def check_close(transport: Any, rank: int, world: int, device: str) -> None:
    """close() is idempotent."""
    transport.close()
    transport.close()


def check_timeout(transport: Any, rank: int, world: int, device: str) -> None:
    """A receive whose sender never sends raises ``TransportError`` naming that peer, within the timeout."""
    if rank == 0:
        transport.submit_recv(torch.empty(16, device=device), 1, 12345)
        start = time.monotonic()
        try:
            transport.run()
        except TransportError as exc:
            if "rank 1" not in str(exc):
                raise AssertionError(f"timeout error does not name rank 1: {exc}") from exc
            waited = time.monotonic() - start
            if waited > 30 * TIMEOUT_CHECK_SECONDS:  # a hang guard, not a speed test
                raise AssertionError(f"{TIMEOUT_CHECK_SECONDS} s timeout fired after {waited:.1f} s") from exc
        else:
            raise AssertionError("a receive nobody sends completed")


CHECKS: dict[str, Callable[[Any, int, int, str], None]] = {
    "dtypes": check_dtypes,
    "order": check_order,
    "shapes": check_shapes,
    "empty_run": check_empty_run,
    "bad_input": check_bad_input,
    "close": check_close,
    "timeout": check_timeout,
}
CHECK_NAMES: tuple[str, ...] = tuple(CHECKS)


def _fail_on(problems: list[str]) -> None:
    if problems:
        raise AssertionError("; ".join(problems))


def _run_one(name: str, transport_cls: type, rank: int, world: int, device: str, options: dict) -> str:
    timeout = TIMEOUT_CHECK_SECONDS if name == "timeout" else 60.0
    # The timeout check leaves its group broken (a timed-out pair is closed), so it gets its own.
    group = dist.new_group(backend=dist.get_backend()) if name == "timeout" else None
    transport = None
    try:
        transport = transport_cls(group=group, timeout=timeout, **options)
        CHECKS[name](transport, rank, world, device)
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if transport is not None:
            try:
                transport.close()
            except Exception as exc:  # close must not fail either
                return f"close() raised {type(exc).__name__}: {exc}"


def _world_entry(
    rank: int, world: int, transport_cls: type, device: str, names: tuple, options: dict
) -> dict[str, str]:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {}
    for name in names:
        results[name] = _run_one(name, transport_cls, rank, world, device, options)
        dist.barrier()
    return results


def run_conformance(
    transport_cls: type,
    world_size: int = 2,
    device: str = "cpu",
    *,
    checks: Sequence[str] | None = None,
    options: dict | None = None,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run the checks (default: all) in one spawned world; ``{name: "ok" or "rank r: error"}``.
    ``env``: extra environment variables for the ranks (``CUDA_VISIBLE_DEVICES="0"`` puts every
    rank on one GPU)."""
    names = tuple(checks) if checks is not None else CHECK_NAMES
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {list(CHECK_NAMES)}")
    if world_size < 2:
        raise ValueError("run_conformance needs world_size >= 2")
    args = (transport_cls, device, names, options or {})
    per_rank = run_world(_world_entry, world_size, *args, timeout=timeout, env=env)
    merged = {}
    for name in names:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
        merged[name] = "; ".join(failures) if failures else "ok"
    return merged


def assert_conformance(transport_cls: type, world_size: int = 2, device: str = "cpu", **kwargs: Any) -> None:
    """``run_conformance`` and raise ``AssertionError`` listing every failed check."""
    results = run_conformance(transport_cls, world_size, device, **kwargs)
    failed = {name: why for name, why in results.items() if why != "ok"}
    if failed:
        raise AssertionError(f"{transport_cls.__name__} failed conformance: {failed}")
