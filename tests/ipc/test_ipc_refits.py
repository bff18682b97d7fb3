"""Every layout the gloo refit tests cover, refit again over ``ipc``: those test files run in a
pytest of their own with ``RESHARD_TRANSPORT=ipc`` (the default transport of every ``refit`` and
``prepare`` that names none), so each of their bit-exact checks holds over shared memory too.

Covered: FSDP2 → DTensor TP and TP×FSDP2, non-colocated TP (``test_refit_layouts``); Megatron-Core
GPTModels across TP/PP (``test_refit_megatron``); delta refits on declared layouts and on Megatron,
transformers and vLLM models (``test_delta_refit``, ``test_delta_models``); verified arrivals
(``test_verify``); formats, Megatron and FSDP2 into vLLM's TP and expert layouts
(``test_refit_vllm``, ``test_refit_megatron_vllm``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard_core.options import RefitOptions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "tests/core/test_refit_layouts.py",
    "tests/core/test_refit_megatron.py",
    "tests/core/test_delta_refit.py",
    "tests/core/test_verify.py",
    "tests/formats/test_refit_vllm.py",
    "tests/formats/test_refit_megatron_vllm.py",
    "tests/formats/test_delta_models.py",
)


def test_the_environment_names_the_default_transport(monkeypatch):
    monkeypatch.delenv("RESHARD_TRANSPORT", raising=False)
    assert RefitOptions().transport == "gloo"
    monkeypatch.setenv("RESHARD_TRANSPORT", "ipc")
    assert RefitOptions().transport == "ipc"
    assert RefitOptions(transport="gloo").transport == "gloo"


def test_the_gloo_refit_tests_pass_over_ipc():
    env = {**os.environ, "RESHARD_TRANSPORT": "ipc"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = "\n".join(done.stdout.splitlines()[-30:])
    assert done.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail and "error" not in tail, tail
