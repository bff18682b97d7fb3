"""The demo's and the benchmark's worlds: ``reshard_core.testing.world.run_world`` with quiet ranks
(import-time library warnings, such as torch without numpy or megatron without apex, would bury the
report) and a grace period after a rank fails, so the others can name their errors before they end."""

from __future__ import annotations

from functools import partial

from reshard_core.testing.world import run_world

ERROR_GRACE_S = 15.0
"""After a rank fails, how long the others get to report their own errors before they are ended."""

QUIET_RANKS = {"PYTHONWARNINGS": "ignore"}

spawn_world = partial(run_world, env=QUIET_RANKS, error_grace=ERROR_GRACE_S)
"""``run_world`` as the demo and the benchmark call it (same arguments, ``on_event`` and ``watchdog``)."""
