"""reshard-vllm: refit a running vLLM engine from a separate training job, shard to shard.

Installing it registers vLLM weight-transfer backend ``"reshard"`` in every vLLM process (entry
point ``vllm.general_plugins``): start the engine with ``weight_transfer_config={"backend": "reshard"}``
(``LLM``) or ``--weight-transfer-config '{"backend": "reshard"}'`` (server). On every trainer rank::

    from reshard_vllm import ReshardTrainerInitInfo
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory,
    )

    info = ReshardTrainerInitInfo("10.0.0.1", 29600, trainer_world_size, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url),
                                                       source=ModuleSource(model))
    engine.send_weights()

Names (imported on first use, which also registers the backend in this process; importing the
package alone imports no vLLM unless vLLM is already imported): ``ReshardTrainerInitInfo``,
``ReshardTrainerWeightTransferEngine``, ``LLMClient`` (an offline ``LLM`` as a weight-sync client),
``ReshardInitInfo``, ``ReshardUpdateInfo``, ``ReshardWeightTransferEngine``, ``register``.
"""

from __future__ import annotations

import sys

_LAZY = {
    "ReshardTrainerInitInfo": "trainer",
    "ReshardTrainerWeightTransferEngine": "trainer",
    "LLMClient": "trainer",
    "ReshardInitInfo": "engine",
    "ReshardUpdateInfo": "engine",
    "ReshardWeightTransferEngine": "engine",
    "register": "registration",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """Import the module defining ``name`` on first use, registering the backend with vLLM."""
    if name in _LAZY:
        import importlib

        from .registration import register

        register()
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "vllm" in sys.modules:  # vLLM is loaded already: registering costs nothing
    try:
        from .registration import register as _register

        _register()
    except Exception:  # a partial or broken vLLM: using a name above raises the real error
        pass
