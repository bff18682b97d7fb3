"""A short, seeded chaos soak (``benchmarks/chaos_soak.py``) against the shared TP2 server: trainer
jobs killed, stopped, restarted and taken over at random phases, malformed calls, injected worker
failures, and a 4-rank world whose ranks fail, stall or die, checked after every step.

It must find no invariant violation (every rank alike, no hang, exit status 0, the engine serving
exactly the version it reports, checked by generation) and leave nothing behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.slow

SEED = 5
UPDATES, FAULTS = 40, 15


def test_a_short_seeded_soak_survives_every_fault_and_leaks_nothing(llama_tp2_server) -> None:
    import chaos_soak

    opts = chaos_soak.Options(seed=SEED, updates=UPDATES, faults=FAULTS)
    server = llama_tp2_server
    tally, leaks, slope = chaos_soak.run(opts, server.url, server.model_dir, server.pids)
    print(chaos_soak.summary(tally, leaks, slope, 0.0))
    assert tally.violations == [], "\n".join(tally.violations)
    assert leaks == [], leaks
    assert sum(tally.injected.values()) == FAULTS and tally.survived == FAULTS, tally
    assert {part for part, _, _ in tally.injected} == {"cross-job", "one-world"}, tally.injected
    assert tally.served >= UPDATES, tally  # each part's updates landed, around the faults
