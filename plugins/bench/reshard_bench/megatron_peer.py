"""Megatron-Core 0.16.1's own refit, ``swap_model_weights(src, dst, "gloo")``, run on a CPU machine.

Its ``GlooCopyService`` moves CPU tensors over Gloo but still creates a ``torch.cuda.Stream()`` and
ends every ``run()`` with ``torch.cuda.current_stream().wait_stream(...)``, which fail without CUDA.
For the duration of the call only, those two names are replaced by a stand-in stream whose methods
do nothing — on CPU there is no asynchronous device work to order, so this changes no result. The
source's ``pg_collection.dp``, which Megatron's planner needs, is filled from ``parallel_state`` as
its own ``reshard_model_weights`` would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch


class StandInStream:
    """Accepts what Megatron's Gloo service asks of a CUDA stream and does nothing."""

    def wait_stream(self, other: Any) -> None:
        """Nothing to order: on CPU every copy has finished when its call returns."""

    def synchronize(self) -> None:
        """Nothing to wait for (as above)."""


@contextmanager
def stand_in_cuda_streams() -> Iterator[None]:
    """``torch.cuda.Stream`` and ``torch.cuda.current_stream`` return a ``StandInStream`` inside."""
    with mock.patch.object(torch.cuda, "Stream", lambda *a, **k: StandInStream()), \
         mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: StandInStream()):  # fmt: skip
        yield


def megatron_refit(src: Any, dst: Any) -> None:
    """``swap_model_weights(src, dst, "gloo")`` on CPU (collective over the world). Its plan is built
    on the first call and cached on ``dst``."""
    from megatron.core import parallel_state
    from megatron.core.resharding.refit import swap_model_weights

    if getattr(src.pg_collection, "dp", None) is None:
        src.pg_collection.dp = parallel_state.get_data_parallel_group()
    with stand_in_cuda_streams():
        swap_model_weights(src, dst, "gloo")
