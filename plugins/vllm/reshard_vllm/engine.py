"""The engine side: vLLM's ``WeightTransferEngine`` for backend ``"reshard"``, one per vLLM worker.

Protocol (the trainer side, ``trainer.py``, drives it through any vLLM weight-sync client):

- ``init_transfer_engine(ReshardInitInfo)``: join the transfer group at ``master_address:master_port``
  as rank ``trainer_world_size + <vLLM rank>`` (closing the previous group: a restarted trainer joins
  again against the same engine);
- ``start_weight_update()``: nothing to prepare (the model is never left half-loaded between RPCs);
- ``receive_weights(ReshardUpdateInfo)``: inside this one RPC, open a layerwise reload
  (``reload.LayerwiseUpdate``), refit the trainer's weights into this worker's checkpoint-layout
  parameters (format "vllm", layout from ``layout.engine_parallel``: only this worker's slices move),
  agree with every rank of the group, then commit the update on every worker or roll it back on
  every worker. A failure raises the same error on every worker; the previous weights stay active;
- ``finish_weight_update()``: record the update's version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import reshard_core
from reshard_core.errors import ReshardError
from reshard_core.formats.vllm import declare_vllm

from .layout import engine_parallel
from .reload import LayerwiseUpdate
from .verdict import Verdict, agree


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """Where the transfer group meets and how many trainer ranks come before the engine's."""

    master_address: str
    master_port: int
    trainer_world_size: int
    timeout: float = 60.0
    transport: str = "gloo"


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """One update; ``version`` is recorded once every worker committed it."""

    version: str | None = None


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
        """Checkpoint-layout receive buffers, kept across updates so the refit's plan is reused."""
        self.version: str | None = None
        """The version of the last update every worker committed (None before the first)."""
        self._pending: str | None = None
        self.last: Verdict | None = None

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
        self.group = reshard_core.TransferGroup.join(
            init_info.master_address, init_info.master_port, rank=trainers + dist.get_rank(),
            size=trainers + workers, job_ranks=range(trainers, trainers + workers), timeout=init_info.timeout,
        )  # fmt: skip
        self.info = init_info

    def start_weight_update(self) -> None:
        self._pending = None

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if self.group is None or self.info is None:
            raise ReshardError(
                "reshard: weights were sent before init_weight_transfer_engine; initialise the transfer "
                "engine (trainer_init on the trainer) first"
            )
        start = time.perf_counter()
        update = LayerwiseUpdate(self.model, self.model_config, self.buffers)
        mine = Verdict.ok()
        try:
            update.open()
            declare_vllm(self.model, engine_parallel(self.model, dist.get_rank()))
            report = reshard_core.refit(
                None, self.model, group=self.group, transport=self.info.transport, timeout=self.info.timeout
            )
            mine = Verdict.ok(received=report.bytes_received, expected=_held_bytes(self.model))
        except Exception as exc:  # every worker must fail alike: the error goes to the verdict
            mine = Verdict.failed(self.group.rank, exc)
        try:
            self.last = agree(self.group, mine, what="vLLM weight update")
        except BaseException:
            update.rollback()
            raise
        if self.last.failures:
            update.rollback()
            raise ReshardError(self.last.message())
        update.commit()
        self._pending = update_info.version
        self.last.seconds = time.perf_counter() - start

    def finish_weight_update(self) -> None:
        if self._pending is not None:
            self.version = self._pending
        self._pending = None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of this worker's checkpoint-layout parameters that a trainer supplies (vocab padding
    rows excluded): what a shard-to-shard refit must deliver here, no more."""
    from reshard_core.extract import ExtractContext
    from reshard_core.formats.vllm import VLLMFormat

    specs = VLLMFormat().logical_specs(model, "dst", ExtractContext.create()).specs
    return sum(spec.tensor.numel() * spec.tensor.element_size() for spec in specs)
