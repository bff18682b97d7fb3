"""The trainer side: vLLM's ``TrainerWeightTransferEngine`` for backend ``"reshard"``.

On every trainer rank::

    info = ReshardTrainerInitInfo("10.0.0.1", 29600, trainer_world_size, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()          # after every optimizer step

``source`` is anything ``reshard_core.refit`` accepts as a source (a Megatron-Core ``GPTModel`` under
any TP/PP/EP, an FSDP2 or DTensor transformers model, a plain module, a list of pipeline chunks),
bare or wrapped in vLLM's ``ModuleSource``. Rank 0 hosts the transfer group's store and drives the
engine through ``client`` (``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``, or
``LLMClient`` for an offline ``LLM``); vLLM's control calls block until the workers are done, so
rank 0 issues them on a side thread while it sends its own slices. Each rank sends only the slices
the workers hold; nothing is gathered.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import reshard_core
from reshard_core import MissingDependency, ReshardError

from .plugin import INSTALL_VLLM
from .verdict import Verdict, agree, failed, ok

try:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
except ModuleNotFoundError as exc:
    raise MissingDependency(__name__, "vllm", INSTALL_VLLM) from exc


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Where the transfer group meets (rank 0 hosts it) and how many trainer ranks there are."""

    backend: ClassVar[str] = "reshard"
    master_address: str
    master_port: int
    trainer_world_size: int
    timeout: float = 60.0
    transport: str = "gloo"


class ReshardTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """Sends one trainer rank's slices to the vLLM workers that hold them."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.model = model_of(source)
        self.info: ReshardTrainerInitInfo | None = None
        self.group: reshard_core.TransferGroup | None = None
        self.last: Verdict | None = None
        """Every rank's outcome of the last ``send_weights`` (bytes each worker received)."""
        self.report: reshard_core.RefitReport | None = None
        """This rank's ``RefitReport`` of the last ``send_weights`` (None when its refit failed)."""

    @classmethod
    def trainer_init(
        cls, init_info: ReshardTrainerInitInfo, *, client: Any, source: Any = None
    ) -> ReshardTrainerWeightTransferEngine:
        """Join the transfer group with the engine's workers (collective over the trainer ranks; rank 0
        also asks the engine to join). Raises ``ReshardError`` naming what failed on either side."""
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        worker_info = {
            "master_address": init_info.master_address,
            "master_port": init_info.master_port,
            "trainer_world_size": init_info.trainer_world_size,
            "timeout": init_info.timeout,
            "transport": init_info.transport,
        }
        with _Background(
            client.init_weight_transfer_engine if engine.is_sender else None, worker_info, init_info.timeout
        ) as call:
            try:
                engine.group = reshard_core.TransferGroup.join(
                    init_info.master_address, init_info.master_port, rank=init_info.rank, size=None,
                    job_ranks=range(init_info.trainer_world_size), timeout=init_info.timeout,
                )  # fmt: skip
            except ReshardError as exc:
                raise ReshardError(f"{exc}{call.failure_note()}") from exc
            call.result("init_weight_transfer_engine")
        return engine

    def send_weights(self, version: str | None = None, *, delta: bool = False) -> Verdict:
        """Refit the engine from ``source``: every trainer rank sends its slices, the workers commit
        together or keep their previous weights together. Returns every rank's outcome; raises
        ``ReshardError`` on every trainer rank when any rank (trainer or worker) failed.

        ``delta=True`` sends only what changed since the last update each worker confirmed
        (``reshard_core.refit(..., delta=True)``): the workers' receive buffers are the baseline,
        and they keep the last update received even when an update is rolled back, so the next
        delta is still exact. Every trainer rank passes the same ``delta``; ``report.delta`` says
        what moved."""
        if self.group is None or self.info is None:
            raise ReshardError(
                "reshard: send_weights() before trainer_init(); initialise the transfer engine first"
            )
        start = time.perf_counter()
        if self.is_sender:
            _control(self.client.start_weight_update, "start_weight_update")
        control = self.client.update_weights if self.is_sender else None
        # a failing worker answers after its refit timed out and its verdict round did: wait that long
        update = {"version": version, "delta": delta}
        self.report = None
        with _Background(control, update, 2 * self.info.timeout + 10) as call:
            mine = ok()
            try:
                self.report = reshard_core.refit(
                    self.model, None, group=self.group, transport=self.info.transport,
                    timeout=self.info.timeout, delta=delta,
                )  # fmt: skip
            except Exception as exc:
                mine = failed(exc)
            self.last = agree(self.group, mine, what="vLLM weight update")
        if self.last.failures:
            if (
                self.is_sender
            ):  # close the update on the workers that returned normally (see engine._fail_alike)
                try:
                    self.client.finish_weight_update(None)
                except Exception:  # fails on the worker vLLM already closed: expected
                    pass
            raise ReshardError(self.last.message())
        call.result("update_weights")
        if self.is_sender:
            _control(self.client.finish_weight_update, "finish_weight_update", version)
        self.last.seconds = time.perf_counter() - start
        return self.last

    def shutdown(self) -> None:
        """Leave the transfer group (the engine leaves it when the next trainer initialises)."""
        if self.group is not None:
            self.group.close()
        self.group = None


def model_of(source: Any) -> Any:
    """The model behind ``source``: a module (or list of pipeline chunks), or vLLM's ``ModuleSource``."""
    if source is None:
        raise ReshardError("reshard: trainer_init needs source= (the trainer's model or a ModuleSource)")
    model = getattr(source, "_module", source)  # vLLM's ModuleSource keeps its module there
    modules = model if isinstance(model, (list, tuple)) else [model]
    import torch

    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise ReshardError(
            "reshard: source must be a torch module, a list of them or a ModuleSource, "
            f"got {type(source).__name__}"
        )
    return model


class LLMClient:
    """vLLM's weight-sync client protocol over an offline ``LLM`` in this process (``LLM`` itself takes
    its requests wrapped: ``{"init_info": ...}``, ``{"update_info": ...}``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class _Background:
    """Runs one blocking control call (``fn(arg)``) on a side thread while this rank moves data."""

    def __init__(self, fn: Any, arg: Any, grace: float = 60.0) -> None:
        self.fn, self.arg, self.grace = fn, arg, grace
        self.pool: ThreadPoolExecutor | None = None
        self.future: Future | None = None

    def __enter__(self) -> _Background:
        if self.fn is not None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-vllm-control")
            self.future = self.pool.submit(self.fn, self.arg)
        return self

    def __exit__(self, *exc: Any) -> None:
        """Give the call up to ``grace`` seconds to finish (its client may not be used concurrently,
        e.g. an offline ``LLM``), then leave it: a call stuck in the engine must not hang the trainer."""
        if self.pool is not None:
            try:
                self.future.result(timeout=self.grace)
            except Exception:  # its outcome was reported (or superseded) by the caller
                pass
            self.pool.shutdown(wait=False)

    def failure_note(self) -> str:
        """The engine's own error, when the call already failed."""
        if self.future is None or not self.future.done() or self.future.exception() is None:
            return ""
        name = getattr(self.fn, "__name__", "call")
        return f" (the engine's {name} failed: {_describe(self.future.exception())})"

    def result(self, what: str) -> None:
        if self.future is None:
            return
        try:
            self.future.result()
        except Exception as exc:
            raise ReshardError(f"reshard: the engine's {what} failed: {_describe(exc)}") from exc


def _control(call: Any, what: str, *args: Any) -> None:
    """A control call to the engine; its failure as a ``ReshardError`` in the engine's words."""
    try:
        call(*args)
    except Exception as exc:
        raise ReshardError(f"reshard: the engine's {what} failed: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    """An engine error in one line; an HTTP error with the server's own message."""
    response = getattr(exc, "response", None)
    text = str(exc)
    if response is not None:
        try:
            text = f"HTTP {response.status_code}: {response.json()['error']['message']}"
        except Exception:
            text = f"HTTP {response.status_code}: {response.text[:500]}"
    return text.strip().replace("\n", " ") or type(exc).__name__
