"""Registers backend ``"reshard"`` with vLLM's weight-transfer factories (both sides).

vLLM calls ``register`` in every process it starts (API server, engine core, workers) through the
``vllm.general_plugins`` entry point, so installing reshard-vllm is all an engine needs. A trainer
process loads no vLLM plugins: there, using any of ``reshard_vllm``'s vLLM classes registers them
(or call ``register()``). Registering twice is a no-op.
"""

from __future__ import annotations

BACKEND = "reshard"


def register() -> None:
    """Make ``weight_transfer_config={"backend": "reshard"}`` and ``ReshardTrainerInitInfo`` work here."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ModuleNotFoundError as exc:
        from reshard_core import MissingDependency

        from .plugin import INSTALL_VLLM

        raise MissingDependency("reshard_vllm", "vllm", INSTALL_VLLM) from exc

    from .vllm_private import registered

    if not registered(WeightTransferEngineFactory, BACKEND):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "reshard_vllm.engine", "ReshardWeightTransferEngine"
        )
    if not registered(WeightTransferTrainerFactory, BACKEND):
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "reshard_vllm.trainer", "ReshardTrainerWeightTransferEngine"
        )
