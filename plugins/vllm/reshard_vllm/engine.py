"""The engine side: vLLM's ``WeightTransferEngine`` for backend ``"reshard"``, one per vLLM worker.

Protocol (the trainer side, ``trainer.py``, drives it through any vLLM weight-sync client). Every
call goes through ``rpc_guard``: each worker's outcome is agreed with the others, a failure closes
the open update on every worker and is raised by one, and no reply is left over for a later call.

- ``init_transfer_engine(ReshardInitInfo)``: check the info, leave the previous trainer's group
  (telling that trainer it was superseded) and join the new one at ``master_address:master_port``
  as rank ``trainer_world_size + <vLLM rank>``; an update left open is aborted first;
- ``start_weight_update()``: forget any staged update (one left open is aborted first);
- ``receive_weights(ReshardUpdateInfo)``: open a reload (``reload.LayerwiseUpdate``;
  ``reload.InPlaceUpdate`` for weights no layer repacks) so the checkpoint-layout parameters are
  backed by the receive buffers, refit the trainer's weights into them (format "vllm", layout from
  ``layout.engine_parallel``: only this worker's slices move), close the reload without touching
  the live weights, and agree with every rank of the group. The update is then staged;
- ``finish_weight_update()``: apply the staged update to the live weights (reopen the reload over
  the buffers and process every layer) and record its version. The weights change in this call
  only, so a trainer that vanishes before it leaves the previous weights serving.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import reshard_core
from reshard_core import MissingDependency, ReshardError
from reshard_core.formats import declare_vllm

from . import rpc_guard
from .layout import check_refittable, engine_parallel
from .plugin import INSTALL_VLLM
from .reload import InPlaceUpdate, LayerwiseUpdate
from .verdict import SUPERSEDED_KEY, Verdict, agree, failed, ok

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
    """One update. ``version`` is recorded when the update is applied (``finish_weight_update``);
    ``delta``: the trainer sends only what changed (``refit(..., delta=True)``, against the receive
    buffers); ``cast``: the wire carries the engine's dtypes (``refit(..., cast=True)``);
    ``ignore``: names (fnmatch patterns) of tensors either side leaves out (``refit(..., ignore=...)``)."""

    version: str | None = None
    delta: bool = False
    cast: bool = False
    ignore: list[str] = dataclasses.field(default_factory=list)


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """Receives shard-to-shard refits from a reshard trainer into one vLLM worker."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False
    reshard_guarded = True
    """Every weight-transfer RPC of this worker goes through ``rpc_guard`` (answered alike)."""

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        rpc_guard.install()
        self.group: reshard_core.TransferGroup | None = None
        self.info: ReshardInitInfo | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        """Checkpoint-layout receive buffers, kept across updates so the refit's plan is reused and
        a delta update has the last update received as its baseline."""
        self.version: str | None = None
        """The version of the update applied last (None before the first)."""
        self.staged: ReshardUpdateInfo | None = None
        """The update every worker received and agreed on, applied by ``finish_weight_update``."""
        self.last: Verdict | None = None
        self._held: int | None = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        info = checked_init_info(init_info)
        parallel = self.vllm_config.parallel_config
        if parallel.data_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            reason = (
                "reshard: engines with data or pipeline parallelism are not supported yet "
                f"(data_parallel_size={parallel.data_parallel_size}, "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size})"
            )
            reshard_core.TransferGroup.refuse(info.master_address, info.master_port, reason)  # no waiting
            raise ReshardError(reason)
        try:
            check_refittable(self.model, dist.get_rank())
        except Exception as exc:  # refused before the trainer sends anything: it learns why at init
            reason = f"reshard: this engine cannot be refit: {rpc_guard.one_line(exc)}"
            reshard_core.TransferGroup.refuse(info.master_address, info.master_port, reason)
            raise ReshardError(reason) from exc
        self._leave(superseded_by=f"{info.master_address}:{info.master_port}")
        trainers, workers = info.trainer_world_size, dist.get_world_size()
        self.group = reshard_core.TransferGroup.join(
            info.master_address, info.master_port, rank=trainers + dist.get_rank(),
            size=trainers + workers, job_ranks=range(trainers, trainers + workers), timeout=info.timeout,
        )  # fmt: skip
        self.info = info

    def start_weight_update(self) -> None:
        self.staged = None

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        """Receive the trainer's weights into the receive buffers and agree with every rank of the
        group; the live weights are left as they are until ``finish_weight_update``."""
        if self.group is None or self.info is None:
            raise ReshardError(
                "reshard: weights were sent before init_weight_transfer_engine; initialise the transfer "
                "engine (trainer_init on the trainer) first"
            )
        start = time.perf_counter()
        mine = ok()
        update: LayerwiseUpdate | InPlaceUpdate | None = None
        ignore, bad = _patterns(update_info.ignore)
        options = reshard_core.RefitOptions(
            group=self.group, transport=self.info.transport, timeout=self.info.timeout,
            delta=bool(update_info.delta), cast=bool(update_info.cast), ignore=ignore,
        )  # fmt: skip
        try:
            try:
                if bad:
                    raise ReshardError(bad)
                update = self._update()
                update.open()
                declare_vllm(self.model, engine_parallel(self.model, dist.get_rank()))
            except Exception as exc:  # every rank of the refit learns it in its first round
                reshard_core.refuse_refit(exc, options)
            report = reshard_core.refit(None, self.model, options)
            if not report.reused_plan or self._held is None:  # the held bytes change with the plan only
                self._held = _held_bytes(self.model)
            mine = ok(report.bytes_received, self._held)
        except Exception as exc:  # every rank must learn it: the error goes to the verdict
            mine = failed(exc)
        if update is not None:  # the buffers keep what arrived; the live weights are untouched
            try:
                update.rollback()
            except Exception as exc:  # still agreed below: every rank of the group waits for this rank
                mine = failed(exc) if mine.startswith("ok") else mine
        self.last = agree(self.group, mine, what="vLLM weight update")
        if self.last.failures:
            raise ReshardError(self.last.message())
        self.staged = update_info
        self.last.seconds = time.perf_counter() - start

    def finish_weight_update(self) -> None:
        """Apply the staged update to the live weights (every worker received it) and record its
        version; the weights and the version change in this one call.

        Two steps, so that the workers apply the update together or not at all: each worker first
        opens its reload over the receive buffers (what can fail before a live tensor changes), then
        every worker learns whether all of them could; only then does each one process its layers.
        A worker that could not open makes every worker close its reload untouched and raise."""
        staged, self.staged = self.staged, None
        update: LayerwiseUpdate | InPlaceUpdate | None = None
        error = ""
        try:
            if staged is not None:
                update = self._update()
                update.open()  # the parameters are backed by the receive buffers, which hold the update
        except Exception as exc:
            error = rpc_guard.one_line(exc)
        failed = [(rank, text) for rank, text in enumerate(rpc_guard.worker_texts(error)) if text]
        if failed:
            if update is not None:
                update.rollback()
            texts = "; ".join(f"worker {rank} could not open its update: {text}" for rank, text in failed)
            raise ReshardError(f"reshard: no worker applied the update (the previous weights stay): {texts}")
        if update is None:
            return
        update.commit()
        self.version = staged.version

    def abort_update(self) -> None:
        """Forget a staged update (``rpc_guard``: the update was aborted); the live weights stay."""
        self.staged = None

    def _update(self) -> LayerwiseUpdate | InPlaceUpdate:
        """How an update reaches the live weights (see ``ReshardInitInfo.inplace``)."""
        why_not = InPlaceUpdate.possible(self.model)
        if self.info.inplace and why_not:
            raise ReshardError(f"reshard: inplace=True, but the model cannot be written in place: {why_not}")
        if self.info.inplace is False or why_not:
            return LayerwiseUpdate(self.model, self.model_config, self.buffers)
        return InPlaceUpdate(self.model, self.buffers)

    def _leave(self, superseded_by: str) -> None:
        """Leave the current trainer's group, telling that trainer (through its store, if it is still
        there) that a newer trainer took the engine over."""
        if self.group is None:
            return
        store = self.group.store
        try:
            store.set_timeout(datetime.timedelta(seconds=2))
            store.set(SUPERSEDED_KEY, superseded_by)
        except Exception:  # the old trainer is gone: nobody to tell
            pass
        self.shutdown()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self.staged = None


def checked_init_info(info: ReshardInitInfo) -> ReshardInitInfo:
    """``info`` with its fields checked (it arrives as JSON from any client); a wrong one is one
    ``ReshardError`` naming the field."""

    def number(name: str, kind: type) -> Any:
        value = getattr(info, name)
        whole = kind is int
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value <= 0
            or (whole and value != int(value))
        ):
            what = "a positive integer" if whole else "a positive number"
            raise ReshardError(f"reshard: init_info.{name} must be {what}, got {value!r}")
        return kind(value)

    address, transport = info.master_address, info.transport
    if not isinstance(address, str) or not address:
        raise ReshardError(f"reshard: init_info.master_address must be a host name, got {address!r}")
    if not isinstance(transport, str):
        raise ReshardError(f"reshard: init_info.transport must be a transport name, got {transport!r}")
    return dataclasses.replace(
        info,
        master_port=number("master_port", int),
        trainer_world_size=number("trainer_world_size", int),
        timeout=number("timeout", float),
    )


def _patterns(value: Any) -> tuple[tuple[str, ...], str]:
    """``update_info.ignore`` (JSON from any client) as patterns, and why it is not a list of names
    ("" when it is)."""
    if value is None:
        return (), ""
    names = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if not names:
        return (), f"reshard: update_info.ignore must be a list of tensor names or patterns, got {value!r}"
    return tuple(value), ""


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of this worker's checkpoint-layout parameters that a trainer supplies (vocab padding
    rows excluded): what a shard-to-shard refit must deliver here, no more."""
    from reshard_core.extract import ExtractContext
    from reshard_core.formats import VLLMFormat

    specs = VLLMFormat().logical_specs(model, "dst", ExtractContext.create()).specs
    return sum(spec.tensor.numel() * spec.tensor.element_size() for spec in specs)
