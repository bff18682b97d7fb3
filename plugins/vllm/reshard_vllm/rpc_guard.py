"""Every weight-transfer RPC is answered alike by every worker of the engine, and answered by its own replies.

vLLM 0.32's executor reads the workers' replies to a ``collective_rpc`` in rank order and raises at
the first error without reading the rest; the unread replies answer the next RPC in its place. So a
call that fails on some workers (a malformed init, an update the trainer left open, vLLM's own
"start_weight_update called while a weight update is already active") leaves stale errors behind,
and the workers' update state drifts apart. ``install`` wraps the worker's weight-transfer methods
(in the worker processes of an engine whose backend is ``"reshard"``) so that each call:

1. repairs what a vanished trainer left: an ``init_weight_transfer_engine`` or ``start_weight_update``
   that finds an update open aborts it first (nothing of it was applied: see ``engine.py``);
2. runs vLLM's own method, catching any error;
3. agrees on the outcome with every worker (an all-gather over vLLM's own CPU group);
4. on any failure, closes the update on every worker alike and raises the failures' text from the
   last worker only, so the executor reads every reply of this call and none is left over.

The wrapped names and the worker state touched (``_weight_update_active``) are vLLM 0.32's;
``install`` refuses a worker that lacks one of the methods.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from reshard_core import ReshardError

logger = logging.getLogger("reshard_vllm")

GUARDED = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "shutdown_weight_transfer_engine",
)
"""The worker methods vLLM's weight-transfer endpoints call (``collective_rpc`` by name)."""

_OPENERS = ("init_weight_transfer_engine", "start_weight_update")
"""Calls that abort an update left open before they run (by a trainer that vanished)."""

_UPDATE_CALLS = ("start_weight_update", "update_weights", "finish_weight_update")
"""Calls whose failure closes the open update on every worker."""


def install() -> None:
    """Wrap vLLM's ``Worker`` weight-transfer methods (once per process; a no-op afterwards)."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker, "_reshard_rpc_guard", False):
        return
    for name in GUARDED:
        original = getattr(Worker, name, None)
        if original is None:
            raise ReshardError(f"reshard: this vLLM's worker has no {name}; vLLM 0.32 or newer is needed")
        setattr(Worker, name, _guarded(name, original))
    Worker._reshard_rpc_guard = True


def _guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(worker: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(worker, "weight_transfer_engine", None)
        if not getattr(engine, "reshard_guarded", False):  # another backend: vLLM's own behaviour
            return original(worker, *args, **kwargs)
        return answer_alike(worker, engine, name, lambda: original(worker, *args, **kwargs))

    return call


def answer_alike(worker: Any, engine: Any, name: str, call: Callable[[], Any]) -> None:
    """Run ``call`` (vLLM's method ``name`` on this worker) with the four steps of the module doc."""
    error = ""
    try:
        if name in _OPENERS and worker._weight_update_active:
            abort_open_update(worker, engine, f"{name} arrived while an update was open")
        call()
    except Exception as exc:
        error = one_line(exc)
    failures = [(rank, text) for rank, text in enumerate(worker_texts(error)) if text]
    if not failures:
        return None
    if name in _UPDATE_CALLS:
        abort_open_update(worker, engine, f"{name} failed")
    message = _message(name, failures)
    logger.error("%s", message)
    if _rank() == _world_size() - 1:  # read last by the executor: no reply of this call is left over
        raise ReshardError(message)
    return None


def abort_open_update(worker: Any, engine: Any, why: str) -> None:
    """Close the open update on this worker: vLLM's flag, its target, and what the engine staged."""
    if worker._weight_update_active:
        logger.warning("reshard: aborting the open weight update (%s); the previous weights stay", why)
    worker._weight_update_active = False
    engine.reset_weight_update_target()
    engine.abort_update()


def _message(name: str, failures: list[tuple[int, str]]) -> str:
    texts = dict.fromkeys(text for _, text in failures)
    if len(failures) == _world_size() and len(texts) == 1:
        return f"{name} failed on every worker: {failures[0][1]}"
    return f"{name} failed: " + "; ".join(f"worker {rank}: {text}" for rank, text in failures)


def worker_texts(text: str) -> list[str]:
    """Every worker's ``text``, in rank order, over vLLM's own CPU group (collective: every worker
    runs the same RPC, and must call it whatever failed before)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [text]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, text, group=group.cpu_group)
    return [str(t) for t in out]


def _rank() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().rank_in_group


def _world_size() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().world_size


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (its type name when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
