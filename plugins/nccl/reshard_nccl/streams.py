"""Stream-ordering and grouping rules of the ``nccl`` transport, as pure functions over stream-like objects.

Kept free of CUDA calls so the rules are testable on a CPU machine with stand-in streams:

1. Before issuing, the transport's side stream waits on the producer (the caller's current stream),
   so NCCL never reads a weight before the kernels that wrote it have finished.
2. Every submitted tensor is marked as used on the side stream (``record_stream``), so the caching
   allocator does not hand its memory to someone else while the transfer may still touch it.
3. Ops are issued with the side stream current (NCCL's internal stream waits on it), and completion
   is awaited on the side stream.
4. The consumer (the caller's current stream when the round completes) waits on the side stream
   before it may read what arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")


def group_by_device(ops: Sequence[T], device_of: Callable[[T], Any]) -> dict[Any, list[T]]:
    """Ops split by device, keeping submission order inside each device (batched P2P is per device)."""
    groups: dict[Any, list[T]] = {}
    for op in ops:
        groups.setdefault(device_of(op), []).append(op)
    return groups


def launch_on_side_stream(
    side: Any,
    producer: Any,
    tensors: Iterable[Any],
    issue: Callable[[], T],
    use_stream: Callable[[Any], AbstractContextManager],
) -> T:
    """Rules 1-3: order ``side`` after ``producer``, pin ``tensors`` to ``side``, run ``issue`` on it."""
    side.wait_stream(producer)
    for tensor in tensors:
        tensor.record_stream(side)
    with use_stream(side):
        return issue()


def complete_on_side_stream(
    side: Any, wait: Callable[[], Any], use_stream: Callable[[Any], AbstractContextManager]
) -> Any:
    """Rule 3: make ``side`` wait for the backend request (``wait`` is the request's ``wait``)."""
    with use_stream(side):
        return wait()


def release_to_consumer(side: Any, consumer: Any) -> None:
    """Rule 4: the consumer stream may use received data only after the side stream got it."""
    consumer.wait_stream(side)
