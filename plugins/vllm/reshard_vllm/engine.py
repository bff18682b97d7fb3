"""The engine side: vLLM's ``WeightTransferEngine`` for backend ``"reshard"``, one per vLLM worker.

Protocol (the trainer side, ``trainer.py``, drives it through any vLLM weight-sync client):

- ``init_transfer_engine(ReshardInitInfo)``: join the transfer group at ``master_address:master_port``
  as rank ``trainer_world_size + <vLLM rank>`` (closing the previous group: a restarted trainer joins
  again against the same engine);
- ``start_weight_update()``: nothing to prepare (the model is never left half-loaded between RPCs);
- ``receive_weights(ReshardUpdateInfo)``: inside this one RPC, open a layerwise reload
  (``reload.LayerwiseUpdate``; ``reload.InPlaceUpdate`` for weights no layer repacks), refit the
  trainer's weights into this worker's checkpoint-layout parameters (format "vllm", layout from
  ``layout.engine_parallel``: only this worker's slices move),
  agree with every rank of the group, then commit the update on every worker or roll it back on
  every worker. A failure is logged by every worker and raised by one (``_fail_alike``); the
  previous weights stay active;
- ``finish_weight_update()``: record the update's version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import reshard_core
from reshard_core import MissingDependency, ReshardError
from reshard_core.formats import declare_vllm

from .layout import engine_parallel
from .plugin import INSTALL_VLLM
from .reload import InPlaceUpdate, LayerwiseUpdate
from .verdict import Verdict, agree, failed, ok

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ModuleNotFoundError as exc:
    raise MissingDependency(__name__, "vllm", INSTALL_VLLM) from exc

logger = logging.getLogger("reshard_vllm")


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """Where the transfer group meets and how many trainer ranks come before the engine's."""

    master_address: str
    master_port: int
    trainer_world_size: int
    timeout: float = 60.0
    transport: str = "gloo"
    inplace: bool | None = None
    """Write parameters in place (``reload.InPlaceUpdate``) instead of through vLLM's layerwise
    reload. None: in place exactly when every parameter is already in its checkpoint layout (an
    unquantized model on a GPU); True when that is not so is an error."""


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One update; ``version`` is recorded once every worker committed it; ``delta``: the trainer
    sends only what changed (``refit(..., delta=True)``, against the receive buffers)."""

    version: str | None = None
    delta: bool = False


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """Receives shard-to-shard refits from a reshard trainer into one vLLM worker."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: reshard_core.TransferGroup | None = None
        self.info: ReshardInitInfo | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        """Checkpoint-layout receive buffers, kept across updates so the refit's plan is reused and
        a delta update has the last update received as its baseline."""
        self.version: str | None = None
        """The version of the last update every worker committed (None before the first)."""
        self._pending: str | None = None
        self.last: Verdict | None = None
        self._held: int | None = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        parallel = self.vllm_config.parallel_config
        if parallel.data_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ReshardError(
                "reshard: engines with data or pipeline parallelism are not supported yet "
                f"(data_parallel_size={parallel.data_parallel_size}, "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size})"
            )
        self.shutdown()  # a restarted trainer: leave the old group before joining the new one
        trainers, workers = int(init_info.trainer_world_size), dist.get_world_size()
        error = ""
        try:
            self.group = reshard_core.TransferGroup.join(
                init_info.master_address, init_info.master_port, rank=trainers + dist.get_rank(),
                size=trainers + workers, job_ranks=range(trainers, trainers + workers),
                timeout=init_info.timeout,
            )  # fmt: skip
            self.info = init_info
        except ReshardError as exc:
            error = str(exc)
        errors = [None] * workers
        dist.all_gather_object(errors, error)  # over vLLM's own world: its workers fail alike
        failed = "; ".join(e for e in dict.fromkeys(errors) if e)
        if failed:
            self.shutdown()
            _fail_alike(f"reshard: the engine could not join the transfer group: {failed}")

    def start_weight_update(self) -> None:
        self._pending = None

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if self.group is None or self.info is None:
            _fail_alike(
                "reshard: weights were sent before init_weight_transfer_engine; initialise the transfer "
                "engine (trainer_init on the trainer) first"
            )
            return
        start = time.perf_counter()
        mine = ok()
        update: LayerwiseUpdate | InPlaceUpdate | None = None
        try:
            update = self._update()
            update.open()
            declare_vllm(self.model, engine_parallel(self.model, dist.get_rank()))
            report = reshard_core.refit(
                None, self.model, group=self.group, transport=self.info.transport, timeout=self.info.timeout,
                delta=bool(update_info.delta),
            )
            if not report.reused_plan or self._held is None:  # the held bytes change with the plan only
                self._held = _held_bytes(self.model)
            mine = ok(report.bytes_received, self._held)
        except Exception as exc:  # every worker must fail alike: the error goes to the verdict
            mine = failed(exc)
        try:
            self.last = agree(self.group, mine, what="vLLM weight update")
        except BaseException:
            if update is not None:
                update.rollback()
            raise
        if self.last.failures:
            if update is not None:
                update.rollback()
            _fail_alike(self.last.message())
            return
        update.commit()
        self._pending = update_info.version
        self.last.seconds = time.perf_counter() - start

    def _update(self) -> LayerwiseUpdate | InPlaceUpdate:
        """How this update reaches the live weights (see ``ReshardInitInfo.inplace``)."""
        why_not = InPlaceUpdate.possible(self.model)
        if self.info.inplace and why_not:
            raise ReshardError(f"reshard: inplace=True, but the model cannot be written in place: {why_not}")
        if self.info.inplace is False or why_not:
            return LayerwiseUpdate(self.model, self.model_config, self.buffers)
        return InPlaceUpdate(self.model, self.buffers)

    def finish_weight_update(self) -> None:
        if self._pending is not None:
            self.version = self._pending
        self._pending = None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


def _fail_alike(message: str) -> None:
    """Raise ``message`` (known to every worker alike) from the last worker only, after logging it.

    vLLM 0.32's executor reads the workers' replies in rank order and raises at the first error
    without reading the others, which then answer the next RPC in its place. An error raised by the
    last worker alone is read after every other reply. The other workers return normally, so their
    update stays open: the trainer ends it with ``finish_weight_update`` (which then fails on the
    last worker alone, whose update vLLM closed when it raised)."""
    logger.error("%s", message)
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ReshardError(message)


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of this worker's checkpoint-layout parameters that a trainer supplies (vocab padding
    rows excluded): what a shard-to-shard refit must deliver here, no more."""
    from reshard_core.extract import ExtractContext
    from reshard_core.formats import VLLMFormat

    specs = VLLMFormat().logical_specs(model, "dst", ExtractContext.create()).specs
    return sum(spec.tensor.numel() * spec.tensor.element_size() for spec in specs)
