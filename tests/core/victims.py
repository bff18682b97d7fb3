"""Helpers of the tests where one rank stalls or dies mid-refit (``test_dead_or_stalled_rank``,
``test_store_host_across_jobs``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def stop_or_kill_at_transport_start(how: str) -> None:
    """From now on this process stops (``how="stop"``: SIGSTOP) or dies (``"kill"``: SIGKILL)
    where its Gloo transport would start a round: in the middle of its next refit."""
    from reshard_gloo.transport import GlooCopyService

    def start(self):
        os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    GlooCopyService.start = start


def timed(attempt: Callable[[], object]) -> tuple[float, str]:
    """``(seconds, outcome)`` of ``attempt()``: "no error", or its error as ``Type: text``."""
    start = time.monotonic()
    try:
        attempt()
        text = "no error"
    except Exception as exc:  # noqa: BLE001 - the text and the time are what the tests check
        text = f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, text
