"""Every quick-start script in ``examples/`` runs as a user would run it and verifies its refit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))
pytestmark = pytest.mark.slow


def test_the_expected_examples_exist():
    assert [p.name for p in EXAMPLES] == ["custom_transport.py", "fsdp2_to_dtensor_tp.py"]


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_and_verifies(script: Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("verified: every weight equal on every rank")
